"""A small Hub-compatible HTTP server for the tests, on 127.0.0.1: the part of the Hub API `huggingface_hub` uses to
create a repository and a branch, upload (preupload, LFS batch + PUT, NDJSON commit) and download (repo info, tree,
paths-info, resolve) files, for model repositories and, read-only, dataset repositories (kept in `state.repos` under
`datasets/<owner>/<name>`). State lives in memory. Only the token `GOOD_TOKEN` may write; reading needs no token.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, unquote, urlparse

GOOD_TOKEN = "hf_test_good_token_0123456789"
LFS_SUFFIXES = (".safetensors", ".png", ".bin")


class Repo:
    def __init__(self, private: bool):
        self.private = private
        self.branches: dict[str, dict[str, bytes]] = {"main": {}}
        self.heads: dict[str, str] = {"main": hashlib.sha1(b"init").hexdigest()}
        self.snapshots: dict[str, dict[str, bytes]] = {self.heads["main"]: {}}  # commit sha -> files
        self.commits: list[dict] = []

    def at(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """(commit sha, files) of a branch name or a commit sha."""
        if revision in self.branches:
            return self.heads[revision], self.branches[revision]
        if revision in self.snapshots:
            return revision, self.snapshots[revision]
        return None


class HubState:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []


def tree_entries(files: dict[str, bytes], under: str, recursive: bool, directories: bool = True) -> list[dict]:
    """The Hub's tree listing of `under`: files (with size and oid) and folders, its direct children or all."""
    prefix = under.strip("/") + "/" if under.strip("/") else ""
    out, folders = [], set()
    for p, c in sorted(files.items()):
        if not p.startswith(prefix):
            continue
        rest = p[len(prefix):].split("/")
        for depth in range(1, len(rest)):
            folders.add(prefix + "/".join(rest[:depth]))
        if recursive or len(rest) == 1:
            out.append({"type": "file", "path": p, "size": len(c), "oid": hashlib.sha1(c).hexdigest()})
    if directories:
        out += [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()} for d in sorted(folders)
                if recursive or "/" not in d[len(prefix):]]
    return out


def make_handler(state: HubState, base_url: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        # ---- helpers
        def _send(self, status: int, body: bytes | dict | None = None, headers: dict | None = None,
                  head: bool = False):
            data = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
            self.send_response(status)
            if isinstance(body, dict):
                self.send_header("Content-Type", "application/json")
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def _error(self, status: int, message: str):
            self._send(status, {"error": message}, {"X-Error-Message": message})

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _authorized(self) -> bool:
            return self.headers.get("Authorization") == f"Bearer {GOOD_TOKEN}"

        def _repo(self, repo_id: str) -> Repo | None:
            return state.repos.get(repo_id)

        def _readable(self, kind: str, repo_id: str, revision: str):
            """(commit, files) of a model or dataset repository at a revision, if this request may read it."""
            repo = self._repo(repo_id if kind == "models" else f"datasets/{repo_id}")
            if repo is None or (repo.private and not self._authorized()):
                return None
            return repo.at(revision)

        # ---- routes
        def do_POST(self):
            path = unquote(urlparse(self.path).path)
            state.requests.append(("POST", path))
            body = self._body()
            if path == "/api/validate-yaml":
                return self._send(200, {"errors": [], "warnings": []})
            if m := re.fullmatch(r"/api/(models|datasets)/(.+?/.+?)/paths-info/([^/]+)", path):
                found = self._readable(m[1], m[2], m[3])
                if found is None:
                    return self._error(404, "Repository not found")
                wanted = [v for k, v in parse_qsl(body.decode()) if k == "paths"]
                entries = [e for e in tree_entries(found[1], "", True, directories=True) if e["path"] in wanted]
                return self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"})
            if not self._authorized():
                return self._error(401, "Invalid credentials in Authorization header")
            if path == "/api/repos/create":
                payload = json.loads(body)
                repo_id = f"{payload['organization']}/{payload['name']}"
                if repo_id in state.repos:  # the Hub answers 409 with the repository's url
                    return self._send(409, {"error": "You already created this model repo",
                                            "url": f"{base_url}/{repo_id}"})
                state.repos[repo_id] = Repo(payload.get("visibility") == "private")
                return self._send(200, {"url": f"{base_url}/{repo_id}", "name": repo_id})
            if m := re.fullmatch(r"/api/models/(.+?/.+?)/branch/(.+)", path):
                repo = self._repo(m[1])
                if repo is None:
                    return self._error(404, "Repository not found")
                if m[2] in repo.branches:
                    return self._error(409, "Reference already exists")
                repo.branches[m[2]] = dict(repo.branches["main"])
                repo.heads[m[2]] = repo.heads["main"]
                return self._send(200, {})
            if m := re.fullmatch(r"/api/models/(.+?/.+?)/preupload/(.+)", path):
                if self._repo(m[1]) is None:
                    return self._error(404, "Repository not found")
                files = json.loads(body)["files"]
                return self._send(200, {"files": [
                    {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES)
                     or "tfevents" in f["path"] else "regular", "shouldIgnore": False} for f in files]})
            if m := re.fullmatch(r"/(.+?/.+?)\.git/info/lfs/objects/batch", path):
                objects = json.loads(body)["objects"]
                out = []
                for o in objects:
                    entry = {"oid": o["oid"], "size": o["size"]}
                    if o["oid"] not in state.lfs:
                        entry["actions"] = {"upload": {"href": f"{base_url}/lfs-upload/{o['oid']}"}}
                    out.append(entry)
                return self._send(200, {"transfer": "basic", "objects": out})
            if m := re.fullmatch(r"/api/models/(.+?/.+?)/commit/(.+)", path):
                repo = self._repo(m[1])
                branch = m[2]
                if repo is None or branch not in repo.branches:
                    return self._error(404, "Repository or revision not found")
                files = dict(repo.branches[branch])
                for line in body.splitlines():
                    item = json.loads(line)
                    value = item["value"]
                    if item["key"] == "file":
                        files[value["path"]] = base64.b64decode(value["content"])
                    elif item["key"] == "lfsFile":
                        if value["oid"] not in state.lfs:
                            return self._error(422, f"LFS object {value['oid']} was never uploaded")
                        files[value["path"]] = state.lfs[value["oid"]]
                    elif item["key"] in ("deletedFile", "deletedFolder"):
                        files = {p: c for p, c in files.items() if p != value["path"]
                                 and not p.startswith(value["path"].rstrip("/") + "/")}
                oid = hashlib.sha1(json.dumps(sorted(files)).encode() + str(len(repo.commits)).encode()).hexdigest()
                repo.branches[branch], repo.heads[branch], repo.snapshots[oid] = files, oid, files
                repo.commits.append({"branch": branch, "oid": oid, "files": sorted(files)})
                return self._send(200, {"commitUrl": f"{base_url}/{m[1]}/commit/{oid}", "commitOid": oid,
                                        "pullRequestUrl": None})
            return self._error(404, f"no route POST {path}")

        def do_PUT(self):
            path = unquote(urlparse(self.path).path)
            state.requests.append(("PUT", path))
            body = self._body()
            if m := re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path):
                if hashlib.sha256(body).hexdigest() != m[1]:
                    return self._error(400, "sha256 mismatch")
                state.lfs[m[1]] = body
                return self._send(200, {})
            return self._error(404, f"no route PUT {path}")

        def do_HEAD(self):
            self.do_GET(head=True)

        def do_GET(self, head: bool = False):
            path = unquote(urlparse(self.path).path)
            state.requests.append(("HEAD" if head else "GET", path))
            if m := re.fullmatch(r"/api/(models|datasets)/(.+?/.+?)/tree/([^/]+)(?:/(.*))?", path):
                found = self._readable(m[1], m[2], m[3])
                if found is None:
                    return self._error(404, "Repository not found")
                recursive = "recursive=true" in (urlparse(self.path).query or "").lower()
                entries = tree_entries(found[1], m[4] or "", recursive)
                return self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"},
                                  head=head)
            if m := re.fullmatch(r"/api/(models|datasets)/(.+?/.+?)(?:/revision/(.+))?", path):
                found = self._readable(m[1], m[2], m[3] or "main")
                if found is None:
                    return self._error(404, "Repository or revision not found")
                return self._send(200, {"id": m[2], "modelId": m[2], "sha": found[0], "private": False,
                                        "siblings": [{"rfilename": p} for p in sorted(found[1])]}, head=head)
            if m := re.fullmatch(r"/datasets/(.+?/.+?)/resolve/([^/]+)/(.+)", path):
                found = self._readable("datasets", m[1], m[2])
                if found is None or m[3] not in found[1]:
                    return self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"},
                                      head=head)
                content = found[1][m[3]]
                return self._send(200, content, {"X-Repo-Commit": found[0],
                                                 "ETag": f'"{hashlib.sha256(content).hexdigest()}"',
                                                 "Content-Type": "application/octet-stream"}, head=head)
            if m := re.fullmatch(r"/(.+?/.+?)/resolve/([^/]+)/(.+)", path):
                repo = self._repo(m[1])
                if repo is None or (repo.private and not self._authorized()):
                    return self._error(404, "Repository not found")
                found = repo.at(m[2])
                if found is None or m[3] not in found[1]:
                    return self._send(404, {"error": "Entry not found"},
                                      {"X-Error-Code": "EntryNotFound"}, head=head)
                content = found[1][m[3]]
                etag = hashlib.sha256(content).hexdigest()
                return self._send(200, content, {"X-Repo-Commit": found[0], "ETag": f'"{etag}"',
                                                 "Content-Type": "application/octet-stream"}, head=head)
            return self._error(404, f"no route GET {path}")

    return Handler


class HubServer:
    """`with HubServer() as hub:` serves on `hub.url` in a background thread; `hub.state` holds the repositories."""

    def __init__(self):
        self.state = HubState()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), None)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.httpd.RequestHandlerClass = make_handler(self.state, self.url)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        return self.state.repos[repo_id].branches[branch]
