"""A test double of the Hugging Face Hub: a loopback HTTP server speaking the parts of the Hub's API
that huggingface_hub uses to create a repo, upload (pre-upload check, the LFS batch API with basic
transfer, commit), list files and download them. It is not the Hub; it is what the real client is
pointed at (HF_ENDPOINT) in tests, since the Hub cannot be reached here. Endpoints and fields are
those huggingface_hub's client (``hf_api.py``) sends and expects (checked against huggingface_hub 2.4):
repo creation, pre-upload check, commit, revision info, tree listing and file download, plus the LFS
path real weight files take (with HF_HUB_DISABLE_XET=1 the client uses LFS rather than Xet).

Accounts: ``whoami-v2`` describes the token's account (``account``, a member of ``orgs``, each with a
role); ``valid_tokens`` may write there, ``read_tokens`` only read, any other token gets 401 on every route
(reading without a token is allowed). Creating a repository or committing outside those namespaces, or with
a read token, gets 403. A commit with ``create_pr``
goes to a new ``refs/pr/N`` revision (the branch it targets is untouched) and answers with the pull
request's URL, as the Hub does.

Knobs for tests: ``fail_lfs_after`` (LFS uploads after the Nth get a 507: an interrupted upload),
``fail_commit`` (the next commit gets this HTTP status), ``drop_commit`` (the next commit's connection
is closed without an answer), ``corrupt_on_commit`` (the next commit stores that file altered: a remote
file whose hash differs); ``unknown_routes`` records requests the double does not speak.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_THRESHOLD = 1024  # files at least this big, or any .safetensors, take the LFS path (the Hub's own rule is similar)


def git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


@dataclass
class StoredFile:
    data: bytes
    lfs: bool

    def entry(self, path: str) -> dict:
        item = {"type": "file", "path": path, "size": len(self.data), "oid": git_blob(self.data)}
        if self.lfs:
            item["lfs"] = {"oid": hashlib.sha256(self.data).hexdigest(), "size": len(self.data), "pointerSize": 134}
        return item


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=lambda: {"main": "0" * 40})
    files: dict[str, dict[str, StoredFile]] = field(default_factory=lambda: {"0" * 40: {}})
    pull_requests: int = 0


class HubTestDouble:
    def __init__(
        self,
        valid_tokens=("hf_test_double_token",),
        read_tokens=(),
        account: str = "user",
        orgs: dict[str, str] | None = None,
    ):
        self.valid_tokens = set(valid_tokens)
        self.read_tokens = set(read_tokens)
        self.account = account
        self.orgs = {"acme": "write", "demo": "write"} if orgs is None else orgs  # organisation -> roleInOrg
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.lfs_uploads = 0
        self.fail_lfs_after: int | None = None
        self.commits = 0
        self.corrupt_on_commit: str | None = None  # a file the next commit stores altered (remote hash differs)
        self.fail_commit: int | None = None  # the next commit gets this HTTP status
        self.drop_commit = False  # the next commit's connection is closed without an answer
        self.unknown_routes: list[str] = []  # requests the double does not speak: a test should expect none
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> HubTestDouble:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def whoami(self, token: str) -> dict:
        """What the Hub's whoami-v2 answers for ``token`` (the fields huggingface_hub and the publisher read)."""
        role = "write" if token in self.valid_tokens else "read"
        return {
            "type": "user",
            "name": self.account,
            "orgs": [{"type": "org", "name": name, "roleInOrg": org_role} for name, org_role in self.orgs.items()],
            "auth": {"type": "access_token", "accessToken": {"displayName": "test double", "role": role}},
        }

    def may_write(self, token: str, repo_id: str) -> bool:
        namespace = repo_id.split("/")[0]
        writable = namespace == self.account or self.orgs.get(namespace, "read") != "read"
        return token in self.valid_tokens and writable

    # ------------------------------------------------------------------ HTTP

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, status: int, value, headers: dict | None = None, content_type="application/json") -> None:
                self._send(status, json.dumps(value).encode(), headers, content_type)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _token(self) -> str:
                return (self.headers.get("Authorization") or "").removeprefix("Bearer ")

            def _authorised(self) -> bool:
                if self._token() in hub.valid_tokens | hub.read_tokens:
                    return True
                self._json(401, {"error": "Invalid credentials in Authorization header"}, {"X-Error-Code": "Unauthorized"})
                return False

            def _may_write(self, repo_id: str) -> bool:
                """Authorised, and allowed to write to ``repo_id``; else a 401 or 403 is sent."""
                if not self._authorised():
                    return False
                if hub.may_write(self._token(), repo_id):
                    return True
                self._json(403, {"error": f"You don't have the rights to write to {repo_id}"}, {"X-Error-Code": "Forbidden"})
                return False

            def _repo(self, repo_id: str) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                return repo

            def do_POST(self) -> None:
                path, _, query = self.path.partition("?")
                self.body = self._body()  # read every request's body, or it would be taken for the next request
                if path == "/api/repos/create":
                    request = json.loads(self.body)
                    repo_id = f"{request.get('organization') or hub.account}/{request['name']}"
                    if not self._may_write(repo_id):
                        return
                    private = bool(request.get("private")) or request.get("visibility") == "private"
                    with hub._lock:
                        if repo_id in hub.repos:
                            return self._json(
                                409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"}
                            )
                        hub.repos[repo_id] = Repo(private)
                    return self._json(200, {"url": f"{hub.url}/{repo_id}"})
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/(.+)", path):
                    if not self._authorised() or self._repo(m[1]) is None:
                        return
                    files = json.loads(self.body)["files"]
                    modes = [
                        {
                            "path": f["path"],
                            "uploadMode": "lfs"
                            if f["size"] >= LFS_THRESHOLD or f["path"].endswith(".safetensors")
                            else "regular",
                            "shouldIgnore": False,
                        }
                        for f in files
                    ]
                    return self._json(200, {"files": modes})
                if m := re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path):
                    if not self._authorised() or self._repo(m[1]) is None:
                        return
                    objects = []
                    for obj in json.loads(self.body)["objects"]:
                        item = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
                        if obj["oid"] not in hub.lfs:  # already stored objects need no upload: resuming skips them
                            item["actions"] = {"upload": {"href": f"{hub.url}/lfs-objects/{obj['oid']}"}}
                        objects.append(item)
                    return self._json(200, {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/(.+)", path):
                    if not self._may_write(m[1]) or (repo := self._repo(m[1])) is None:
                        return
                    return self._commit(m[1], repo, m[2].replace("%2F", "/"), "create_pr=1" in query.split("&"))
                if path == "/api/validate-yaml":  # model card metadata; the double checks only that it is there
                    content = json.loads(self.body).get("content", "")
                    if content.startswith("---\n") and "\n---" in content[4:]:
                        return self._json(200, {"errors": [], "warnings": []})
                    return self._json(400, {"errors": [{"message": "no YAML front matter"}], "warnings": []})
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/branch/(.+)", path):
                    if not self._may_write(m[1]) or (repo := self._repo(m[1])) is None:
                        return
                    repo.branches.setdefault(m[2], repo.branches["main"])
                    return self._json(200, {})
                hub.unknown_routes.append(f"POST {self.path}")
                self._json(404, {"error": f"no route for POST {path}"})

            def _commit(self, repo_id: str, repo: Repo, revision: str, create_pr: bool) -> None:
                """Commit onto ``revision``, or with ``create_pr`` onto a new refs/pr/N branched from it."""
                if hub.drop_commit:
                    hub.drop_commit = False
                    self.close_connection = True
                    self.connection.shutdown(2)  # socket.SHUT_RDWR: the client sees the connection drop
                    return None
                if hub.fail_commit is not None:
                    status, hub.fail_commit = hub.fail_commit, None
                    return self._json(status, {"error": "test double: the commit failed"})
                if (head := self._resolve_revision(repo, revision)) is None:
                    return self._json(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                files = dict(repo.files[head])
                summary = ""
                for line in self.body.splitlines():
                    item = json.loads(line)
                    value = item["value"]
                    if item["key"] == "header":
                        summary = value.get("summary", "")
                    elif item["key"] == "file":
                        files[value["path"]] = StoredFile(base64.b64decode(value["content"]), lfs=False)
                    elif item["key"] == "lfsFile":
                        if value["oid"] not in hub.lfs:
                            return self._json(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                        files[value["path"]] = StoredFile(hub.lfs[value["oid"]], lfs=True)
                    elif item["key"] == "deletedFile":
                        files.pop(value["path"], None)
                if hub.corrupt_on_commit in files:
                    stored = files[hub.corrupt_on_commit]
                    files[hub.corrupt_on_commit] = StoredFile(stored.data[:-1] + bytes([stored.data[-1] ^ 1]), stored.lfs)
                    hub.corrupt_on_commit = None
                with hub._lock:
                    hub.commits += 1
                    sha = hashlib.sha1(f"{repo_id}{hub.commits}{summary}".encode()).hexdigest()
                    repo.files[sha] = files
                    pr_url = None
                    if create_pr:
                        repo.pull_requests += 1
                        revision = f"refs/pr/{repo.pull_requests}"
                        pr_url = f"{hub.url}/{repo_id}/discussions/{repo.pull_requests}"
                    repo.branches[revision] = sha
                self._json(200, {"commitOid": sha, "commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "pullRequestUrl": pr_url})

            def do_PUT(self) -> None:
                m = re.fullmatch(r"/lfs-objects/([0-9a-f]{64})", self.path)
                if not m:
                    return self._json(404, {"error": "no route"})
                data = self._body()
                with hub._lock:
                    hub.lfs_uploads += 1
                    fail = hub.fail_lfs_after is not None and hub.lfs_uploads > hub.fail_lfs_after
                if fail:
                    # 507 rather than 500: the client retries 5xx gateway errors for ~20 s before giving up
                    return self._json(507, {"error": "insufficient storage (test double: an interrupted upload)"})
                if hashlib.sha256(data).hexdigest() != m[1]:
                    return self._json(400, {"error": "sha256 mismatch"})
                hub.lfs[m[1]] = data
                self._send(200)

            def _revision(self, repo_id: str, revision: str) -> tuple[Repo, str] | None:
                """The repository and commit a request names, or None once a 404 like the Hub's is sent."""
                if (repo := self._repo(repo_id)) is None:
                    return None
                if (sha := self._resolve_revision(repo, revision)) is None:
                    self._json(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                    return None
                return repo, sha

            def _resolve_revision(self, repo: Repo, revision: str) -> str | None:
                revision = revision.replace("%2F", "/")
                if revision in repo.branches:
                    return repo.branches[revision]
                return revision if revision in repo.files else None

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/api/agent-harnesses":  # huggingface_hub's agent detection registry: an empty one
                    return self._json(200, {"standardEnvVars": [], "harnesses": {}})
                if self._token() and not self._authorised():  # the Hub answers an unknown token with 401 everywhere
                    return None
                if path == "/api/whoami-v2":
                    if self._authorised():
                        self._json(200, hub.whoami(self._token()))
                    return None
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path):
                    if (found := self._revision(m[1], m[2])) is None:
                        return
                    repo, sha = found
                    siblings = [{"rfilename": p} for p in sorted(repo.files[sha])]
                    return self._json(200, {"id": m[1], "sha": sha, "siblings": siblings, "private": repo.private})
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path):
                    if (found := self._revision(m[1], m[2])) is None:
                        return
                    repo, sha = found
                    return self._json(200, [stored.entry(p) for p, stored in sorted(repo.files[sha].items())])
                if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                    return self._download(m[1], m[2], m[3])
                hub.unknown_routes.append(f"{self.command} {self.path}")
                self._json(404, {"error": f"no route for GET {path}"})

            def do_HEAD(self) -> None:
                self.do_GET()

            def _download(self, repo_id: str, revision: str, file: str) -> None:
                if (repo := self._repo(repo_id)) is None:
                    return
                sha = self._resolve_revision(repo, revision)
                stored = repo.files.get(sha, {}).get(file) if sha else None
                if stored is None:
                    return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                etag = hashlib.sha256(stored.data).hexdigest() if stored.lfs else git_blob(stored.data)
                headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"'}
                if stored.lfs:
                    headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(stored.data))})
                self._send(200, stored.data, headers, content_type="application/octet-stream")

        return Handler


def main(argv: list[str]) -> int:
    """``python tests/hub_test_double.py -- COMMAND...``: run COMMAND against a fresh double, then stop it.

    The environment points huggingface_hub at the double (HF_ENDPOINT, a token it accepts, LFS rather
    than Xet, a private cache), so a publish can be tried end to end without the Hub.
    """
    import os
    import subprocess
    import tempfile

    command = argv[argv.index("--") + 1 :] if "--" in argv else argv
    hub = HubTestDouble().start()
    with tempfile.TemporaryDirectory(prefix="hub-test-double-") as home:
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": next(iter(hub.valid_tokens)),
            "HF_HUB_DISABLE_XET": "1",
            "HF_HOME": home,
        }
        print(f"Hub test double listening on {hub.url}", flush=True)
        try:
            return subprocess.run(command, env=env, check=False).returncode
        finally:
            hub.stop()


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
