"""Run the FastDeploy conformance suite (tests/fastdeploy_real) on every FastDeploy build the package checks.

    python scripts/conformance_builds.py --src /path/to/FastDeploy            # every build of support.BUILDS
    python scripts/conformance_builds.py --src DIR --build release/2.5 -k qwen3   # one build, some cases
    python scripts/conformance_builds.py --src DIR --json                     # one JSON document on stdout

``--src`` is a FastDeploy git directory (a clone, or a bare mirror) that holds every commit asked for: upstream
``develop`` holds 8c3513a4 and e53f5184; the release heads are on ``release/2.5`` and ``release/2.6`` (in a clone:
``git fetch origin release/2.5 release/2.6``). Nothing is fetched here: a missing commit is refused, naming it. CI
runs one build (``support.CI_BUILD``, .ci/run); this is the opt-in run of all of them, one after another, each in
its own pytest process with ``HPU_FP8_FASTDEPLOY_REF`` set to the build's commit (tests/fastdeploy_real/
fd_environment.py builds one Python environment per FastDeploy requirements list, cached). Per build it prints the
cases passed, failed and skipped (with each skip's reason and each failure's name); the exit status is 1 if any
build had a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from hpu_fp8_loader.fastdeploy import support

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "tests" / "fastdeploy_real"


def _has_commit(src: Path, commit: str) -> bool:
    git_dir = src / ".git" if (src / ".git").exists() else src
    found = subprocess.run(
        ["git", "--git-dir", str(git_dir), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True, check=False
    )
    return found.returncode == 0


def _results(junit: Path) -> dict:
    """Counts and names from pytest's JUnit XML."""
    passed, failed, skipped = [], [], []
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif (skip := case.find("skipped")) is not None:
            skipped.append(f"{name}: {skip.get('message', '')}")
        else:
            passed.append(name)
    return {"passed": len(passed), "failed": failed, "skipped": skipped}


def run_build(build: support.FastDeployBuild, src: Path, extra: list[str]) -> dict:
    """One pytest run of the suite on ``build``; its results."""
    with tempfile.TemporaryDirectory() as work:
        junit = Path(work) / "junit.xml"
        env = {**os.environ, "HPU_FP8_FASTDEPLOY_SRC": str(src), "HPU_FP8_FASTDEPLOY_REF": build.commit.commit}
        env["HPU_FP8_REQUIRE_FASTDEPLOY"] = "1"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", str(SUITE), *extra]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if not junit.is_file():
            return {"build": build.name, "commit": build.commit.short, "error": done.stdout[-2000:] + done.stderr[-2000:]}
        return {"build": build.name, "commit": build.commit.short, "exit": done.returncode, **_results(junit)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, required=True, help="a FastDeploy git directory holding every commit asked for")
    known = ", ".join(f"{b.name} {b.commit.short}" for b in support.BUILDS)
    parser.add_argument("--build", action="append", help=f"a build's branch or commit (repeatable; default: all of {known})")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the summary")
    parser.add_argument("-k", help="pytest's -k expression: only the matching cases")
    args = parser.parse_args(argv)
    wanted = args.build or []
    builds = [b for b in support.BUILDS if not wanted or any(b.name == w or b.commit.commit.startswith(w) for w in wanted)]
    if not builds:
        parser.error(f"--build {' '.join(wanted)}: none of {known}")
    missing = [f"{b.name} {b.commit.commit}" for b in builds if not _has_commit(args.src, b.commit.commit)]
    if missing:
        print(f"conformance_builds: {args.src} lacks {', '.join(missing)}; fetch them there first", file=sys.stderr)
        return 2
    extra = ["-k", args.k] if args.k else []
    results = []
    for build in builds:
        print(f"conformance_builds: {build.name} at {build.commit.short} ...", file=sys.stderr, flush=True)
        results.append(run_build(build, args.src, extra))
    if args.json:
        print(json.dumps(results, indent=2))
    for result in [] if args.json else results:
        head = f"{result['build']} {result['commit']}:"
        if "error" in result:
            print(f"{head} the suite did not run:\n{result['error']}")
            continue
        print(f"{head} {result['passed']} passed, {len(result['failed'])} failed, {len(result['skipped'])} skipped")
        for name in result["failed"]:
            print(f"  FAILED {name}")
        for line in result["skipped"]:
            print(f"  skipped {line}")
    return 1 if any("error" in r or r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
