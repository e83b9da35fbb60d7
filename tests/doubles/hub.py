"""A test double of the Hugging Face Hub: a loopback HTTP server speaking the parts of the Hub's API
that huggingface_hub uses to create a repo, upload (pre-upload check, the LFS batch API with basic
transfer, commit), list files and download them. It is not the Hub; it is what the real client is
pointed at (HF_ENDPOINT) in tests, since the Hub cannot be reached here. Endpoints and fields are
those huggingface_hub's client (``hf_api.py``) sends and expects (checked against huggingface_hub 2.4):
repo creation, pre-upload check, commit, revision info, tree listing and file download, plus the LFS
path real weight files take (with HF_HUB_DISABLE_XET=1 the client uses LFS rather than Xet).
``HubTestDouble.ROUTES`` lists them: (method, path pattern, handler); HEAD is answered as GET, without a body.

Accounts: ``whoami-v2`` describes the token's account (``account``, a member of ``orgs``, each with a
role); ``valid_tokens`` may write there, ``read_tokens`` only read, any other token gets 401 on every read
and on every route that needs a token (reading without a token is allowed). Creating a repository or
committing outside those namespaces, or with a read token, gets 403. A commit with ``create_pr``
goes to a new ``refs/pr/N`` revision (the branch it targets is untouched) and answers with the pull
request's URL, as the Hub does.

Knobs for tests: ``fail_lfs_after`` (LFS uploads after the Nth get a 507: an interrupted upload),
``fail_commit`` (the next commit gets this HTTP status), ``drop_commit`` (the next commit's connection
is closed without an answer), ``corrupt_on_commit`` (the next commit stores that file altered: a remote
file whose hash differs); ``unknown_routes`` records requests the double does not speak.

Knobs for a hostile or broken Hub: ``file_headers`` are sent with every file download (``resolve``), replacing
the double's own (``{"ETag": '"../../../x"'}``: the blob name huggingface_hub takes unchecked);
``replies[ROUTE]`` rewrites the JSON body a route answers with (``ROUTE`` is the handler's name, e.g.
``revision_info``, ``tree``, ``whoami_v2``, ``commit``; the function gets the body the double would send and
returns what is sent instead, any JSON value).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_THRESHOLD = 1024  # files at least this big, or any .safetensors, take the LFS path (the Hub's own rule is similar)
REPO = r"([^/]+/[^/]+)"  # a repository id, namespace/name


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


class Request(BaseHTTPRequestHandler):
    """One request: its path (``target``, ``query``), body and token, and the means to answer it.
    What it asks for is the double's business (``HubTestDouble.dispatch``)."""

    protocol_version = "HTTP/1.1"
    route = ""  # the name of the handler that answers (dispatch sets it), for HubTestDouble.replies

    def log_message(self, *args) -> None:  # quiet
        pass

    def _receive(self) -> None:
        self.target, _, self.query = self.path.partition("?")
        self.method = "GET" if self.command == "HEAD" else self.command
        self.body = self.rfile.read(int(self.headers.get("Content-Length") or 0))  # or it is taken for the next request
        self.server.hub.dispatch(self)

    def do_GET(self) -> None:
        self._receive()

    def do_HEAD(self) -> None:
        self._receive()

    def do_POST(self) -> None:
        self._receive()

    def do_PUT(self) -> None:
        self._receive()

    @property
    def token(self) -> str:
        return (self.headers.get("Authorization") or "").removeprefix("Bearer ")

    def reply(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def reply_json(self, status: int, value, headers: dict | None = None, content_type="application/json") -> None:
        rewrite = self.server.hub.replies.get(self.route)
        if rewrite is not None and status == 200:
            value = rewrite(value)
        self.reply(status, json.dumps(value).encode(), headers, content_type)


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
        self.file_headers: dict[str, str] = {}  # sent with every file download, replacing the double's own
        self.replies: dict[str, Callable[[object], object]] = {}  # route name -> rewrite of its JSON body
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Request)
        self.server.hub = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # shutdown() waits for serve_forever's next poll: 0.5 s by default, paid by every test that stops a double
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)

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

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, request: Request) -> None:
        """The first route of ``ROUTES`` whose method and pattern match answers; none: ``no_route``."""
        handler, match = HubTestDouble.no_route, None
        for method, pattern, route in self.ROUTES:
            if method == request.method and (found := pattern.fullmatch(request.target)):
                handler, match = route, found
                break
        request.route = handler.__name__
        if request.method == "GET" and handler not in self.TOKENLESS and request.token and not self._authorised(request):
            return  # the Hub answers a token it does not know with 401 on every read
        handler(self, request, match)

    def no_route(self, request: Request, _match: None) -> None:
        self.unknown_routes.append(f"{request.command} {request.path}")
        request.reply_json(404, {"error": f"no route for {request.method} {request.target}"})

    # The checks routes share: each answers the request itself (401, 403, 404) when it fails.

    def _authorised(self, request: Request) -> bool:
        if request.token in self.valid_tokens | self.read_tokens:
            return True
        request.reply_json(401, {"error": "Invalid credentials in Authorization header"}, {"X-Error-Code": "Unauthorized"})
        return False

    def _may_write(self, request: Request, repo_id: str) -> bool:
        """Authorised, and allowed to write to ``repo_id``; else a 401 or 403 is sent."""
        if not self._authorised(request):
            return False
        if self.may_write(request.token, repo_id):
            return True
        request.reply_json(403, {"error": f"You don't have the rights to write to {repo_id}"}, {"X-Error-Code": "Forbidden"})
        return False

    def _repo(self, request: Request, repo_id: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            request.reply_json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        return repo

    def _revision(self, request: Request, repo_id: str, revision: str) -> tuple[Repo, str] | None:
        """The repository and commit a request names, or None once a 404 like the Hub's is sent."""
        if (repo := self._repo(request, repo_id)) is None:
            return None
        if (sha := self._resolve_revision(repo, revision)) is None:
            request.reply_json(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
            return None
        return repo, sha

    @staticmethod
    def _resolve_revision(repo: Repo, revision: str) -> str | None:
        revision = revision.replace("%2F", "/")
        if revision in repo.branches:
            return repo.branches[revision]
        return revision if revision in repo.files else None

    # ------------------------------------------------------------------ routes: reading

    def agent_harnesses(self, request: Request, _match) -> None:
        """huggingface_hub's agent detection registry: an empty one, whatever the token."""
        request.reply_json(200, {"standardEnvVars": [], "harnesses": {}})

    def whoami_v2(self, request: Request, _match) -> None:
        if self._authorised(request):
            request.reply_json(200, self.whoami(request.token))

    def revision_info(self, request: Request, m: re.Match) -> None:
        if (found := self._revision(request, m[1], m[2])) is not None:
            repo, sha = found
            siblings = [{"rfilename": p} for p in sorted(repo.files[sha])]
            request.reply_json(200, {"id": m[1], "sha": sha, "siblings": siblings, "private": repo.private})

    def tree(self, request: Request, m: re.Match) -> None:
        if (found := self._revision(request, m[1], m[2])) is not None:
            repo, sha = found
            request.reply_json(200, [stored.entry(p) for p, stored in sorted(repo.files[sha].items())])

    def resolve(self, request: Request, m: re.Match) -> None:
        """Download one file: its bytes, with the commit and ETag headers huggingface_hub checks."""
        repo_id, revision, file = m[1], m[2], m[3]
        if (repo := self._repo(request, repo_id)) is None:
            return
        sha = self._resolve_revision(repo, revision)
        stored = repo.files.get(sha, {}).get(file) if sha else None
        if stored is None:
            return request.reply_json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
        etag = hashlib.sha256(stored.data).hexdigest() if stored.lfs else git_blob(stored.data)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"'}
        if stored.lfs:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(stored.data))})
        headers.update(self.file_headers)
        request.reply(200, stored.data, headers, content_type="application/octet-stream")

    # ------------------------------------------------------------------ routes: writing

    def create_repo(self, request: Request, _match) -> None:
        body = json.loads(request.body)
        repo_id = f"{body.get('organization') or self.account}/{body['name']}"
        if not self._may_write(request, repo_id):
            return
        private = bool(body.get("private")) or body.get("visibility") == "private"
        with self._lock:
            if repo_id in self.repos:
                return request.reply_json(409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"})
            self.repos[repo_id] = Repo(private)
        request.reply_json(200, {"url": f"{self.url}/{repo_id}"})

    def preupload(self, request: Request, m: re.Match) -> None:
        """Each file's upload mode: LFS for big files and weights, regular otherwise."""
        if not self._authorised(request) or self._repo(request, m[1]) is None:
            return
        modes = [
            {
                "path": f["path"],
                "uploadMode": "lfs" if f["size"] >= LFS_THRESHOLD or f["path"].endswith(".safetensors") else "regular",
                "shouldIgnore": False,
            }
            for f in json.loads(request.body)["files"]
        ]
        request.reply_json(200, {"files": modes})

    def lfs_batch(self, request: Request, m: re.Match) -> None:
        """The LFS batch API, basic transfer: an upload action for each object not stored yet."""
        if not self._authorised(request) or self._repo(request, m[1]) is None:
            return
        objects = []
        for obj in json.loads(request.body)["objects"]:
            item = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.lfs:  # already stored objects need no upload: resuming skips them
                item["actions"] = {"upload": {"href": f"{self.url}/lfs-objects/{obj['oid']}"}}
            objects.append(item)
        request.reply_json(200, {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")

    def lfs_upload(self, request: Request, m: re.Match) -> None:
        """An LFS object's bytes (the batch API's upload href), stored under their sha256."""
        with self._lock:
            self.lfs_uploads += 1
            fail = self.fail_lfs_after is not None and self.lfs_uploads > self.fail_lfs_after
        if fail:
            # 507 rather than 500: the client retries 5xx gateway errors for ~20 s before giving up
            return request.reply_json(507, {"error": "insufficient storage (test double: an interrupted upload)"})
        if hashlib.sha256(request.body).hexdigest() != m[1]:
            return request.reply_json(400, {"error": "sha256 mismatch"})
        self.lfs[m[1]] = request.body
        request.reply(200)

    def commit(self, request: Request, m: re.Match) -> None:
        """Commit onto the revision named, or with ``create_pr=1`` onto a new refs/pr/N branched from it."""
        repo_id, revision, create_pr = m[1], m[2].replace("%2F", "/"), "create_pr=1" in request.query.split("&")
        if not self._may_write(request, repo_id) or (repo := self._repo(request, repo_id)) is None:
            return None
        if self.drop_commit:
            self.drop_commit = False
            request.close_connection = True
            request.connection.shutdown(2)  # socket.SHUT_RDWR: the client sees the connection drop
            return None
        if self.fail_commit is not None:
            status, self.fail_commit = self.fail_commit, None
            return request.reply_json(status, {"error": "test double: the commit failed"})
        if (head := self._resolve_revision(repo, revision)) is None:
            return request.reply_json(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
        files = dict(repo.files[head])
        summary = ""
        for line in request.body.splitlines():
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "header":
                summary = value.get("summary", "")
            elif item["key"] == "file":
                files[value["path"]] = StoredFile(base64.b64decode(value["content"]), lfs=False)
            elif item["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    return request.reply_json(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                files[value["path"]] = StoredFile(self.lfs[value["oid"]], lfs=True)
            elif item["key"] == "deletedFile":
                files.pop(value["path"], None)
        if self.corrupt_on_commit in files:
            stored = files[self.corrupt_on_commit]
            files[self.corrupt_on_commit] = StoredFile(stored.data[:-1] + bytes([stored.data[-1] ^ 1]), stored.lfs)
            self.corrupt_on_commit = None
        with self._lock:
            self.commits += 1
            sha = hashlib.sha1(f"{repo_id}{self.commits}{summary}".encode()).hexdigest()
            repo.files[sha] = files
            pr_url = None
            if create_pr:
                repo.pull_requests += 1
                revision = f"refs/pr/{repo.pull_requests}"
                pr_url = f"{self.url}/{repo_id}/discussions/{repo.pull_requests}"
            repo.branches[revision] = sha
        request.reply_json(200, {"commitOid": sha, "commitUrl": f"{self.url}/{repo_id}/commit/{sha}", "pullRequestUrl": pr_url})

    def create_branch(self, request: Request, m: re.Match) -> None:
        if not self._may_write(request, m[1]) or (repo := self._repo(request, m[1])) is None:
            return
        repo.branches.setdefault(m[2], repo.branches["main"])
        request.reply_json(200, {})

    def validate_yaml(self, request: Request, _match) -> None:
        """Model card metadata; the double checks only that it is there."""
        content = json.loads(request.body).get("content", "")
        if content.startswith("---\n") and "\n---" in content[4:]:
            return request.reply_json(200, {"errors": [], "warnings": []})
        request.reply_json(400, {"errors": [{"message": "no YAML front matter"}], "warnings": []})

    ROUTES = (
        ("GET", re.compile(r"/api/agent-harnesses"), agent_harnesses),
        ("GET", re.compile(r"/api/whoami-v2"), whoami_v2),
        ("GET", re.compile(rf"/api/models/{REPO}/revision/(.+)"), revision_info),
        ("GET", re.compile(rf"/api/models/{REPO}/tree/([^/]+)(/.*)?"), tree),
        ("GET", re.compile(rf"/{REPO}/resolve/([^/]+)/(.+)"), resolve),
        ("POST", re.compile(r"/api/repos/create"), create_repo),
        ("POST", re.compile(rf"/api/models/{REPO}/preupload/(.+)"), preupload),
        ("POST", re.compile(rf"/{REPO}\.git/info/lfs/objects/batch"), lfs_batch),
        ("POST", re.compile(rf"/api/models/{REPO}/commit/(.+)"), commit),
        ("POST", re.compile(r"/api/validate-yaml"), validate_yaml),
        ("POST", re.compile(rf"/api/models/{REPO}/branch/(.+)"), create_branch),
        ("PUT", re.compile(r"/lfs-objects/([0-9a-f]{64})"), lfs_upload),
    )
    TOKENLESS = (agent_harnesses,)  # reads answered whatever the token; every other read refuses an unknown one


def main(argv: list[str]) -> int:
    """``python tests/doubles/hub.py -- COMMAND...``: run COMMAND against a fresh double, then stop it.

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
