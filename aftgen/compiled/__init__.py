"""Everything that traces, packages, caches and loads compiled code, apart from the model it compiles.

cache: aftgen's cache folder of compiled files, checked against their records before they are loaded. aoti: a
step package's library called through its C interface, without Python's lock. step: the model's step compiled
ahead of time (torch.export, then AOTInductor). functions: torch.compile with an eager fallback (the prompt
reader's chunks, training's step). cache and aoti sit below the model (aftgen.native builds into the cache);
step and functions above it.
"""
