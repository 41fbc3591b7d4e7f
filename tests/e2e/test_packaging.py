"""What ``pip install .`` (not editable) installs, and that it runs from any folder.

The repository keeps router/, server/ and bench/sim/ at its top level; the
wheel installs them as tailguard.router, tailguard.server and tailguard.sim
(pyproject's package-dir). These tests build the real wheel, install it into
a fresh virtual environment whose only other path is the dependencies
already installed here, and run the installed ``tailguard`` command from a
temporary folder, away from the checkout.

The container image is checked the same way without Docker: the build
context is assembled as ``docker build -f deploy/Dockerfile .`` would send
it (deploy/Dockerfile.dockerignore applied by the Docker SDK's own matcher),
the Dockerfile's COPY lines are replayed into a folder, and that folder is
``pip install``-ed and run as the image's entrypoint would be.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from docker.utils.build import PatternMatcher

from tests.helpers.process import config_on_free_ports, exited, free_port, until_healthy

ROOT = Path(__file__).resolve().parents[2]
# Where each installed package's source lives in the repository.
SOURCES = {
    "tailguard.router": ROOT / "router",
    "tailguard.server": ROOT / "server",
    "tailguard.sim": ROOT / "bench" / "sim",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("tailguard-*.whl")
    return built


def fresh_venv(home: Path, what: Path) -> Path:
    """A venv at ``home`` with ``what`` (a wheel or a source folder) installed; the dependencies,
    and setuptools to build a folder, come from this interpreter's site-packages through a plain
    path entry (its .pth files, the editable install's finder among them, are not read there)."""
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True
    ).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation"]
    installing = subprocess.run([*pip, str(what)], capture_output=True, text=True)
    assert installing.returncode == 0, installing.stderr
    return home


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the wheel installed."""
    yield fresh_venv(tmp_path_factory.mktemp("venv"), wheel)


def installed_run(home: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(home / "bin" / "tailguard"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_the_wheel_installs_one_tailguard_namespace_and_no_benchmark_driver(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"tailguard"}
    assert "tailguard/server/config.toml" in names and "tailguard/server/py.typed" in names
    assert not [name for name in names if name.startswith("tailguard/bench")]
    assert not [name for name in names if name.endswith(("limits_doc.py", "protogen.py"))]  # generators stay in the checkout
    # Every module of the source folders is in the wheel, under its installed name.
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" not in path.parts:
                assert f"{package.replace('.', '/')}/{path.relative_to(folder).as_posix()}" in names


def test_pyproject_lists_every_package_under_the_source_folders() -> None:
    """setuptools installs only the packages listed; a new sub-package must be added there."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for package, folder in SOURCES.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder)
            found.add(".".join([package, *relative.parts]))
    assert listed == found


def test_nothing_imports_the_simulator_as_bench_sim() -> None:
    """``bench.sim`` and ``tailguard.sim`` would be two copies of one module, with two sets of classes."""
    by_old_name = re.compile(r"^\s*(from|import) bench(\.sim\b(?!_)| import sim\b)", re.M)
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("router", "server", "bench", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if by_old_name.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_check_config_runs_from_any_folder_on_the_shipped_config(installed: Path, tmp_path: Path) -> None:
    result = installed_run(installed, tmp_path, "check-config")
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("config file: ") and first.endswith("tailguard/server/config.toml")
    assert str(installed) in first  # the installed copy, not the checkout's
    assert "pool interactive" in result.stdout


def test_advise_runs_from_any_folder_on_a_trace(installed: Path, tmp_path: Path) -> None:
    """The planner and its replay of the router ship in the wheel; it prints no command that needs a checkout."""
    trace = tmp_path / "trace.jsonl"
    shutil.copy(ROOT / "bench" / "results" / "tail" / "example-trace.jsonl", trace)
    result = installed_run(installed, tmp_path, "advise", "--trace", str(trace), "--engines", "2")
    assert result.returncode == 0, result.stderr
    assert "Recommended: " in result.stdout and "[pools.batch]" in result.stdout
    assert "python -m bench" not in result.stdout


async def test_serve_simulate_answers_from_a_temporary_folder(installed: Path, tmp_path: Path) -> None:
    ports = [free_port() for _ in range(4)]
    config_on_free_ports(tmp_path, ports)  # ./config.toml wins over the shipped one
    await serve_one_completion(installed, tmp_path, ports[0])


async def serve_one_completion(home: Path, cwd: Path, http_port: int) -> None:
    """``tailguard serve --simulate`` from ``cwd``: healthy, one streamed completion, a clean SIGTERM."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process = subprocess.Popen(
        [str(home / "bin" / "tailguard"), "serve", "--simulate", "--log-level", "WARNING"],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as client:
            await until_healthy(client, process, seconds=40)
            body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[0][len("data: ") :])["object"] == "chat.completion.chunk"
        process.send_signal(signal.SIGTERM)
        assert await exited(process) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        assert process.stderr is not None
        process.stderr.close()


# -- the container image (deploy/Dockerfile), built without Docker --------------------------

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
# BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile instead of the context's .dockerignore.
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


def dockerignore_patterns(path: Path) -> list[str]:
    """The ignore file's patterns as the Docker SDK reads them: blank lines and ``#`` comments dropped."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def build_context(root: Path, patterns: list[str]) -> set[str]:
    """The paths (files, folders, links) under ``root`` that ``docker build`` sends, relative to it."""
    return set(PatternMatcher(patterns).walk(str(root)))


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) for each instruction: comments dropped, ``\\`` continuations joined."""
    instructions = []
    logical = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not logical and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        word, _, rest = (logical + line).strip().partition(" ")
        instructions.append((word.upper(), rest.strip()))
        logical = ""
    return instructions


def docker_copy(context: Path, source: str, target: Path) -> None:
    """One COPY source into ``target``, as Docker copies it: a folder's contents (its links kept
    as links), a file (a link named as the source itself is followed); a source outside the
    context is an error, as ``docker build`` says "not found"."""
    assert not any(c in source for c in "*?["), f"COPY {source}: wildcards are not replayed here"
    path = context / source
    assert path.exists() or path.is_symlink(), f"COPY {source}: not in the build context"
    if path.is_dir():
        shutil.copytree(path, target, symlinks=True, dirs_exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)  # follows the link


def image_source_tree(context: Path, image: Path) -> Path:
    """Replay the Dockerfile's WORKDIR and COPY lines into ``image`` (the image's root);
    return the folder its ``pip install .`` runs in."""
    workdir = Path("/")
    installed_from = None
    for instruction, arguments in dockerfile_instructions(DOCKERFILE):
        if instruction == "WORKDIR":
            workdir = workdir / arguments
        elif instruction in ("COPY", "ADD"):
            assert instruction == "COPY" and not arguments.startswith("--") and not arguments.startswith("["), (
                f"{instruction} {arguments}: only plain COPY is replayed here"
            )
            *sources, destination = shlex.split(arguments)
            assert len(sources) == 1 or destination.endswith("/"), f"COPY {arguments}: several sources need a folder"
            base = image / (workdir / destination).relative_to("/")
            for source in sources:
                is_file = not (context / source).is_dir()
                docker_copy(context, source, base / Path(source).name if is_file and destination.endswith("/") else base)
        elif instruction == "RUN" and "pip install" in arguments:
            # The checkout itself, with the tracing extra at most (the image can turn [tracing] on).
            assert re.search(r"\bpip install (\.|'\.\[tracing\]')(\s|$)", arguments), f"RUN {arguments}: expected `pip install .`"
            installed_from = image / workdir.relative_to("/")
    assert installed_from is not None, "the Dockerfile runs no `pip install .`"
    return installed_from


def assemble_context(root: Path, into: Path) -> Path:
    """The build context, copied file by file as Docker sends it (links as links)."""
    for relative in sorted(build_context(root, dockerignore_patterns(DOCKERIGNORE))):
        source, target = root / relative, into / relative
        if source.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(source), target)
        elif source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return into


def test_the_ignore_matcher_reads_dockers_rules(tmp_path: Path) -> None:
    """The library's matcher applies the rules the ignore file relies on: the last matching
    pattern wins, ``!`` re-includes, ``**`` spans folders, a folder's pattern covers its files."""
    for name in ("keep.toml", "drop.txt", "pkg/a.py", "pkg/__pycache__/a.pyc", "pkg/sub/__pycache__/b.pyc", "pkg/out/x.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    sent = build_context(tmp_path, ["*", "!keep.toml", "!pkg/", "**/__pycache__", "pkg/out/"])
    assert {p for p in sent if not (tmp_path / p).is_dir()} == {"keep.toml", "pkg/a.py"}


def test_the_build_context_has_what_the_image_installs_and_nothing_else() -> None:
    sent = build_context(ROOT, dockerignore_patterns(DOCKERIGNORE))
    for needed in ("pyproject.toml", "README.md", "config.toml", "server/config.toml", "router/config/load.py", "bench/sim/__init__.py"):
        assert needed in sent, needed
    assert not [p for p in sent if "__pycache__" in p or p.endswith(".pyc") or p.startswith(("bench/results", ".venv", ".git/", "build/"))]


async def test_the_images_install_has_its_default_config_and_serves(tmp_path: Path) -> None:
    """What ``docker build -f deploy/Dockerfile .`` installs: ``check-config`` finds the packaged
    default config with no --config, and ``serve --simulate`` answers a completion."""
    context = assemble_context(ROOT, tmp_path / "context")
    source = image_source_tree(context, tmp_path / "image")
    home = fresh_venv(tmp_path / "venv", source)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    checked = installed_run(home, elsewhere, "check-config")
    assert checked.returncode == 0, checked.stderr
    shipped = Path(checked.stdout.splitlines()[0].removeprefix("config file: "))
    assert shipped.is_relative_to(home) and shipped.name == "config.toml" and not shipped.is_symlink()
    assert "pool interactive" in checked.stdout
    # The packaged config, moved to free ports, as ./config.toml.
    ports = [free_port() for _ in range(4)]
    text = shipped.read_text(encoding="utf-8")
    for old, new in (("127.0.0.1:8080", ports[0]), (":8001", ports[1]), (":8002", ports[2]), ("127.0.0.1:50051", ports[3])):
        assert old in text, old
        text = text.replace(old, f"{old.rsplit(':', 1)[0]}:{new}")
    (elsewhere / "config.toml").write_text(text, encoding="utf-8")
    await serve_one_completion(home, elsewhere, ports[0])
