"""A small in-memory Hugging Face Hub on 127.0.0.1, enough for huggingface_hub's real download and upload code.

It answers what snapshot_download / hf_hub_download and create_repo / create_branch / create_commit ask
(regular uploads only: every file travels base64-encoded inside the NDJSON commit), and fails the way the
Hub does: 404 with X-Error-Code RepoNotFound | RevisionNotFound | EntryNotFound. Private repos are only
visible to requests carrying `Authorization: Bearer <token>`.

    with FakeHub(token="hf_test") as hub:
        env = {"HF_ENDPOINT": hub.url, ...}
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_blob_id(content: bytes) -> str:
    """The id git (and so the Hub's ETag for non-LFS files) gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Repo:
    private: bool = False
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> {path: content}

    def resolve(self, revision: str) -> str | None:
        """A branch name or a full commit sha -> the commit sha, None if neither."""
        return self.branches.get(revision) or (revision if revision in self.commits else None)


class FakeHub:
    """The server, run on a background thread; `repos` is its whole state, open to the test for inspection."""

    def __init__(self, token: str | None = None):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path), in arrival order
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Shut down and free the port: later requests get 'connection refused', as with no network."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def create_repo(self, repo_id: str, private: bool = False) -> Repo:
        """A repo with one initial commit holding .gitattributes, as the Hub makes them."""
        with self._lock:
            repo = self.repos[repo_id] = Repo(private=private)
        self.commit(repo_id, "main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"})
        return repo

    def commit(self, repo_id: str, branch: str, files: dict[str, bytes], deleted: tuple[str, ...] = ()) -> str:
        """Add a commit on `branch` (created if new) on top of its last one; returns the commit sha."""
        with self._lock:
            repo = self.repos[repo_id]
            tree = dict(repo.commits.get(repo.branches.get(branch, ""), {}))
            tree.update(files)
            for path in deleted:
                tree.pop(path, None)
            sha = hashlib.sha1(f"{repo_id}:{len(repo.commits)}:{sorted(tree)}".encode()).hexdigest()
            repo.commits[sha] = tree
            repo.branches[branch] = sha
            return sha

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return repo.commits[repo.resolve(revision)]


class HubError(Exception):
    def __init__(self, status: int, code: str | None = None, message: str = ""):
        super().__init__(message or code or str(status))
        self.status, self.code, self.message = status, code, message or code or ""


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
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

        def _dispatch(self, method: str) -> None:
            path = urlsplit(self.path).path
            hub.requests.append((method, path))
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
            try:
                if path.startswith("/api/"):
                    self._api(method, path.removeprefix("/api/").split("/"), body)
                else:
                    self._resolve(method, path.strip("/").split("/"))
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
            headers = {
                "X-Repo-Commit": sha,
                "ETag": f'"{git_blob_id(content)}"',
                "Content-Type": "application/octet-stream",
            }
            self._send(200, content, headers)

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
                    {"type": "file", "path": name, "size": len(content), "oid": git_blob_id(content)}
                    for name, content in sorted(repo.commits[sha].items())
                    if name.startswith(prefix)
                ]
                return self._reply(200, tree)
            if method == "POST" and action == "preupload" and rest:
                self._commit(repo, rest[0])
                files = json.loads(body)["files"]
                return self._reply(
                    200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
                )
            if method == "POST" and action == "commit" and rest:
                return self._commit_files(repo_id, repo, rest[0], body)
            if method == "POST" and action == "branch" and rest:
                return self._create_branch(repo_id, repo, unquote("/".join(rest)), json.loads(body or b"{}"))
            raise HubError(404, None, "no such endpoint")

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

        def _commit_files(self, repo_id: str, repo: Repo, revision: str, body: bytes) -> None:
            self._require_write()
            branch = unquote(revision)
            if branch not in repo.branches:
                raise HubError(404, "RevisionNotFound", f"Invalid rev id: {branch}")
            files, deleted = {}, []
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    value = item["value"]
                    files[value["path"]] = (
                        base64.b64decode(value["content"])
                        if value.get("encoding") == "base64"
                        else value["content"].encode()
                    )
                elif item["key"] == "deletedFile":
                    deleted.append(item["value"]["path"])
                elif item["key"] != "header":
                    raise HubError(400, None, f"this fake Hub only takes regular files, not {item['key']}")
            sha = hub.commit(repo_id, branch, files, tuple(deleted))
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
