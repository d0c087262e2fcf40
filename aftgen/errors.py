"""The one error type aftgen raises for anything the user can fix."""


class AftgenError(Exception):
    """A problem with the user's input, files or options; its message says what to do."""
