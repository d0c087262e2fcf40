"""A small in-memory Hugging Face Hub on 127.0.0.1, enough for huggingface_hub's real download and upload code.

It answers what snapshot_download / hf_hub_download and create_repo / create_branch / create_commit ask, and
fails the way the Hub does: 404 with X-Error-Code RepoNotFound | RevisionNotFound | EntryNotFound. Private
repos are only visible to requests carrying `Authorization: Bearer <token>`.

Files that the repo's .gitattributes routes to Git LFS take the Hub's LFS path: preupload answers "lfs", the
client asks the LFS batch API where to put the content, PUTs it to a storage server on another port (the
Hub's S3), verifies it, and names it by sha256 in an `lfsFile` commit line; downloading one, /resolve answers
302 to that storage with X-Linked-Etag (the sha256) and X-Linked-Size. Other files travel base64-encoded
inside the NDJSON commit. The storage being another host matters: huggingface_hub stops its HEAD at a
redirect off the Hub, reads the file's metadata from the 302, and sends no token to the storage.

huggingface_hub uploads LFS files through Xet storage when hf_xet is installed; this fake does not speak
Xet, so clients need HF_HUB_DISABLE_XET=1 (the Git LFS path, which the Hub still serves).

    with FakeHub(token="hf_test") as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", ...}
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

# The model-file lines of the .gitattributes the Hub puts in every new model repo (it has ~35 such patterns).
GITATTRIBUTES = b"".join(
    b"%s filter=lfs diff=lfs merge=lfs -text\n" % ext for ext in (b"*.bin", b"*.model", b"*.pt", b"*.safetensors")
)
STORAGE_PREFIX = "/lfs-objects/"


def git_blob_id(content: bytes) -> str:
    """The id git (and so the Hub's ETag for non-LFS files) gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def lfs_pointer(content: bytes) -> bytes:
    """The small text file git stores in place of an LFS file's content."""
    oid = sha256(content).encode()
    return b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n" % (oid, len(content))


def lfs_tracked(path: str, gitattributes: bytes) -> bool:
    """Whether .gitattributes sends `path` to LFS (a pattern with no slash matches the name at any depth, as in git)."""
    patterns = [line.split()[0] for line in gitattributes.decode().splitlines() if "filter=lfs" in line.split()[1:]]
    return any(fnmatch(path if "/" in pattern else path.rsplit("/", 1)[-1], pattern) for pattern in patterns)


@dataclass
class Repo:
    private: bool = False
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> {path: content}
    lfs: dict[str, frozenset[str]] = field(default_factory=dict)  # commit sha -> its paths stored as LFS pointers

    def resolve(self, revision: str) -> str | None:
        """A branch name or a full commit sha -> the commit sha, None if neither."""
        return self.branches.get(revision) or (revision if revision in self.commits else None)


class FakeHub:
    """The server and its LFS storage, run on background threads; `repos`, `lfs_objects` and `requests` are its
    whole state, open to the test for inspection."""

    def __init__(self, token: str | None = None):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}  # sha256 -> content: what the storage holds
        self._announced: dict[str, int] = {}  # sha256 -> size, as the batch API was told before the upload
        self.requests: list[tuple[str, str]] = []  # (method, path), in arrival order; storage paths included
        self._lock = threading.Lock()
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, storage)) for storage in (False, True)]
        self._threads = [threading.Thread(target=server.serve_forever, daemon=True) for server in self._servers]
        for server in self._servers:
            server.daemon_threads = True

    @property
    def url(self) -> str:
        return _server_url(self._servers[0])

    @property
    def storage_url(self) -> str:
        """Where LFS content is uploaded and downloaded: another host, like the Hub's S3 / CDN (`localhost`, not
        127.0.0.1: huggingface_hub before 2.4 tells a redirect off the Hub by its host name alone, not its port)."""
        return _server_url(self._servers[1]).replace("127.0.0.1", "localhost")

    def __enter__(self) -> FakeHub:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Shut down and free the ports: later requests get 'connection refused', as with no network."""
        for server, thread in zip(self._servers, self._threads, strict=True):
            if thread.is_alive():
                server.shutdown()
            server.server_close()

    def create_repo(self, repo_id: str, private: bool = False) -> Repo:
        """A repo with one initial commit holding .gitattributes, as the Hub makes them."""
        with self._lock:
            repo = self.repos[repo_id] = Repo(private=private)
        self.commit(repo_id, "main", {".gitattributes": GITATTRIBUTES})
        return repo

    def commit(
        self,
        repo_id: str,
        branch: str,
        files: dict[str, bytes],
        deleted: tuple[str, ...] = (),
        lfs: set[str] | None = None,
    ) -> str:
        """Add a commit on `branch` (created if new) on top of its last one; returns the commit sha.

        `lfs` names the files stored as LFS pointers; by default those .gitattributes tracks, as `git push` does.
        """
        with self._lock:
            repo = self.repos[repo_id]
            parent = repo.branches.get(branch, "")
            tree = dict(repo.commits.get(parent, {}))
            tree.update(files)
            for path in deleted:
                tree.pop(path, None)
            if lfs is None:
                lfs = {path for path in files if lfs_tracked(path, tree.get(".gitattributes", b""))}
            for path in lfs:  # planted files too: /resolve sends the client to the storage for them
                self.lfs_objects.setdefault(sha256(files[path]), files[path])
            stored_as_lfs = (repo.lfs.get(parent, frozenset()) - set(files) | lfs) & set(tree)
            sha = hashlib.sha1(f"{repo_id}:{len(repo.commits)}:{sorted(tree)}".encode()).hexdigest()
            repo.commits[sha], repo.lfs[sha] = tree, frozenset(stored_as_lfs)
            repo.branches[branch] = sha
            return sha

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return repo.commits[repo.resolve(revision)]

    def lfs_files(self, repo_id: str, revision: str = "main") -> set[str]:
        """The paths at `revision` stored as LFS pointers (for a commit made by the client: those sent as lfsFile)."""
        repo = self.repos[repo_id]
        return set(repo.lfs[repo.resolve(revision)])


def _server_url(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


class HubError(Exception):
    def __init__(self, status: int, code: str | None = None, message: str = ""):
        super().__init__(message or code or str(status))
        self.status, self.code, self.message = status, code, message or code or ""


def _handler(hub: FakeHub, storage: bool) -> type[BaseHTTPRequestHandler]:
    """The request handler of the Hub itself, or (storage=True) of its LFS storage."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's client expects

        def log_message(self, *args) -> None:  # quiet: the test output is the tests'
            pass

        def do_HEAD(self) -> None:
            self._dispatch("HEAD")

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def _dispatch(self, method: str) -> None:
            path = urlsplit(self.path).path
            hub.requests.append((method, path))
            has_body = method in ("POST", "PUT")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if has_body else b""
            parts = path.strip("/").split("/")
            try:
                if storage:
                    self._storage(method, path, body)
                elif path.startswith("/api/"):
                    self._api(method, path.removeprefix("/api/").split("/"), body)
                elif len(parts) == 6 and parts[1].endswith(".git") and parts[2:5] == ["info", "lfs", "objects"]:
                    repo_id = f"{parts[0]}/{parts[1].removesuffix('.git')}"  # /{repo_id}.git/info/lfs/objects/...
                    self._lfs(method, repo_id, parts[5], json.loads(body or b"{}"))
                else:
                    self._resolve(method, parts)
            except HubError as error:
                self._reply(error.status, {"error": error.message}, {"X-Error-Code": error.code} if error.code else {})

        # -- reading -----------------------------------------------------------------------------------

        def _repo(self, repo_id: str) -> Repo:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and not self._authorised()):
                raise HubError(404, "RepoNotFound", f"Repository {repo_id} not found")
            return repo

        def _commit(self, repo: Repo, revision: str) -> str:
            sha = repo.resolve(unquote(revision))
            if sha is None:
                raise HubError(404, "RevisionNotFound", f"Invalid rev id: {unquote(revision)}")
            return sha

        def _authorised(self) -> bool:
            return hub.token is not None and self.headers.get("Authorization") == f"Bearer {hub.token}"

        def _resolve(self, method: str, parts: list[str]) -> None:
            # /{owner}/{name}/resolve/{revision}/{path...}
            if len(parts) < 5 or parts[2] != "resolve":
                raise HubError(404, None, "no such page")
            repo = self._repo("/".join(parts[:2]))
            sha = self._commit(repo, parts[3])
            name = unquote("/".join(parts[4:]))
            content = repo.commits[sha].get(name)
            if content is None:
                raise HubError(404, "EntryNotFound", f"{name} does not exist on {parts[3]}")
            if name in repo.lfs[sha]:  # the content is in LFS storage: the client reads X-Linked-* and follows
                location = f"{hub.storage_url}{STORAGE_PREFIX}{sha256(content)}"
                headers = {
                    "X-Repo-Commit": sha,
                    "ETag": f'"{git_blob_id(lfs_pointer(content))}"',  # what git stores; the client must not use it
                    "X-Linked-Etag": f'"{sha256(content)}"',
                    "X-Linked-Size": str(len(content)),
                    "Location": location,
                }
                return self._send(302, f"Found. Redirecting to {location}".encode(), headers)
            headers = {
                "X-Repo-Commit": sha,
                "ETag": f'"{git_blob_id(content)}"',
                "Content-Type": "application/octet-stream",
            }
            self._send(200, content, headers)

        def _storage(self, method: str, path: str, body: bytes) -> None:
            oid = path.removeprefix(STORAGE_PREFIX)
            if method == "PUT" and path.startswith(STORAGE_PREFIX):
                return self._store(oid, body)
            content = hub.lfs_objects.get(oid)
            if method not in ("GET", "HEAD") or not path.startswith(STORAGE_PREFIX) or content is None:
                raise HubError(404, None, "no such object")
            self._send(200, content, {"ETag": f'"{oid}"', "Content-Type": "application/octet-stream"})

        def _api(self, method: str, parts: list[str], body: bytes) -> None:
            if method == "POST" and parts == ["repos", "create"]:
                return self._create_repo(json.loads(body))
            if method == "POST" and parts == ["validate-yaml"]:
                return self._reply(200, {"errors": [], "warnings": []})
            if len(parts) < 3 or parts[0] != "models":
                raise HubError(404, None, "no such endpoint")
            repo_id, action, rest = "/".join(parts[1:3]), (parts[3:4] or ["info"])[0], parts[4:]
            repo = self._repo(repo_id)
            if method == "GET" and action in ("info", "revision"):
                sha = self._commit(repo, rest[0] if rest else "main")
                siblings = [{"rfilename": name} for name in sorted(repo.commits[sha])]
                return self._reply(200, {"id": repo_id, "sha": sha, "private": repo.private, "siblings": siblings})
            if method == "GET" and action == "tree" and rest:
                sha = self._commit(repo, rest[0])
                prefix = unquote("/".join(rest[1:]))
                tree = [
                    _tree_entry(name, content, name in repo.lfs[sha])
                    for name, content in sorted(repo.commits[sha].items())
                    if name.startswith(prefix)
                ]
                return self._reply(200, tree)
            if method == "POST" and action == "preupload" and rest:
                return self._preupload(repo, rest[0], json.loads(body)["files"])
            if method == "POST" and action == "commit" and rest:
                return self._commit_files(repo_id, repo, rest[0], body)
            if method == "POST" and action == "branch" and rest:
                return self._create_branch(repo_id, repo, unquote("/".join(rest)), json.loads(body or b"{}"))
            if action == "xet-write-token":  # hf_xet's upload starts here; its error would be hard to read
                raise HubError(501, None, "this fake Hub speaks Git LFS, not Xet: set HF_HUB_DISABLE_XET=1")
            raise HubError(404, None, "no such endpoint")

        def _preupload(self, repo: Repo, revision: str, files: list[dict]) -> None:
            gitattributes = repo.commits[self._commit(repo, revision)].get(".gitattributes", b"")
            modes = [
                {"path": f["path"], "uploadMode": "lfs" if lfs_tracked(f["path"], gitattributes) else "regular"}
                for f in files
            ]
            self._reply(200, {"files": [mode | {"shouldIgnore": False} for mode in modes]})

        # -- writing -----------------------------------------------------------------------------------

        def _require_write(self) -> None:
            if hub.token is not None and not self._authorised():
                raise HubError(401, None, "Invalid credentials in Authorization header")

        def _create_repo(self, payload: dict) -> None:
            self._require_write()
            repo_id = f"{payload['organization']}/{payload['name']}"
            if repo_id in hub.repos:  # the Hub still names the repo, which create_repo(exist_ok=True) reads
                return self._reply(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
            hub.create_repo(repo_id, private=payload.get("visibility") == "private" or bool(payload.get("private")))
            self._reply(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def _create_branch(self, repo_id: str, repo: Repo, branch: str, payload: dict) -> None:
            self._require_write()
            if branch in repo.branches:
                raise HubError(409, None, f"Reference refs/heads/{branch} already exists")
            start = self._commit(repo, payload.get("startingPoint") or "main")
            with hub._lock:
                repo.branches[branch] = start
            self._reply(200, {})

        def _lfs(self, method: str, repo_id: str, action: str, payload: dict) -> None:
            """The Git LFS batch API (upload only) and the verify call that follows an upload."""
            self._repo(repo_id)
            self._require_write()
            if method == "POST" and action == "batch" and payload.get("operation") == "upload":
                return self._lfs_batch(repo_id, payload["objects"])
            if method == "POST" and action == "verify":
                content = hub.lfs_objects.get(payload["oid"])
                if content is None or len(content) != payload["size"]:
                    raise HubError(400, None, f"object {payload['oid']} of {payload['size']} bytes was not uploaded")
                return self._reply(200, {})
            raise HubError(404, None, "no such endpoint")

        def _lfs_batch(self, repo_id: str, objects: list[dict]) -> None:
            answers = []
            for item in objects:
                oid, size = item["oid"], item["size"]
                answer = {"oid": oid, "size": size, "authenticated": True}
                if oid not in hub.lfs_objects:  # an object stored already gets no actions: the client skips it
                    with hub._lock:
                        hub._announced[oid] = size
                    answer["actions"] = {
                        "upload": {"href": f"{hub.storage_url}{STORAGE_PREFIX}{oid}"},
                        "verify": {"href": f"{hub.url}/{repo_id}.git/info/lfs/objects/verify"},
                    }
                answers.append(answer)
            body = json.dumps({"transfer": "basic", "objects": answers}).encode()
            self._send(200, body, {"Content-Type": "application/vnd.git-lfs+json"})

        def _store(self, oid: str, content: bytes) -> None:
            """A PUT to the storage, allowed as a presigned URL would: for an object the batch API announced."""
            with hub._lock:
                size = hub._announced.get(oid)
                if size is None:
                    raise HubError(403, None, f"no upload of {oid} was asked of the LFS batch API")
                if len(content) != size or sha256(content) != oid:
                    got = f"{len(content)} bytes with sha256 {sha256(content)}"
                    raise HubError(400, None, f"got {got}; the batch request announced {size} bytes, {oid}")
                hub.lfs_objects[oid] = content
            self._send(200, b"", {})

        def _commit_files(self, repo_id: str, repo: Repo, revision: str, body: bytes) -> None:
            self._require_write()
            branch = unquote(revision)
            if branch not in repo.branches:
                raise HubError(404, "RevisionNotFound", f"Invalid rev id: {branch}")
            files, deleted, lfs = _read_commit(body, hub.lfs_objects)
            sha = hub.commit(repo_id, branch, files, deleted, lfs)
            self._reply(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha})

        # -- replies -----------------------------------------------------------------------------------

        def _reply(self, status: int, payload, headers: dict[str, str] | None = None) -> None:
            self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _send(self, status: int, content: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(content)))  # the real size, on HEAD too
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(content)

    return Handler


def _tree_entry(name: str, content: bytes, lfs: bool) -> dict:
    """A /tree listing entry: for an LFS file, `oid` is the pointer's blob id and `lfs` describes the content."""
    if not lfs:
        return {"type": "file", "path": name, "size": len(content), "oid": git_blob_id(content)}
    pointer = lfs_pointer(content)
    lfs_info = {"oid": sha256(content), "size": len(content), "pointerSize": len(pointer)}
    return {"type": "file", "path": name, "size": len(content), "oid": git_blob_id(pointer), "lfs": lfs_info}


def _read_commit(body: bytes, lfs_objects: dict[str, bytes]) -> tuple[dict[str, bytes], tuple[str, ...], set[str]]:
    """An NDJSON commit -> (files, deleted paths, the paths sent as lfsFile, whose content must be in storage)."""
    files, deleted, lfs = {}, [], set()
    for line in body.splitlines():
        item = json.loads(line)
        value = item["value"]
        if item["key"] == "file":
            encoded = value.get("encoding") == "base64"
            files[value["path"]] = base64.b64decode(value["content"]) if encoded else value["content"].encode()
        elif item["key"] == "lfsFile":
            content = lfs_objects.get(value["oid"])
            if content is None or len(content) != value.get("size", len(content)):
                raise HubError(400, None, f"{value['path']}: LFS object {value['oid']} was never uploaded")
            files[value["path"]] = content
            lfs.add(value["path"])
        elif item["key"] == "deletedFile":
            deleted.append(value["path"])
        elif item["key"] != "header":
            raise HubError(400, None, f"this fake Hub does not take {item['key']}")
    return files, tuple(deleted), lfs
