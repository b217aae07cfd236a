"""Every fenced block of the README and of the guides (``docs/guides/*.md``) runs as written.

Python blocks run as they are, each in a fresh process, from a directory that holds the
repository's ``examples/`` and ``scripts/`` (as a user at the repository's root). Shell blocks run
through bash with the reductions the README states: training runs 3 steps, the planner compiles
1 layout, and a two-node launch runs both nodes here, one process each. The set-up commands of
the README's first two blocks are the ones CI runs; its file tree lists real files; every
relative link of every document leads to a file that exists.
"""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
from helpers import TEST_XLA_FLAGS

ROOT = pathlib.Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def fenced_blocks(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """``(language, text, line)`` of each fenced block of a document."""
    text = path.read_text()
    return [(m.group(1), m.group(2), text[: m.start()].count("\n") + 1) for m in FENCE.finditer(text)]


BLOCKS = {path.relative_to(ROOT).as_posix(): fenced_blocks(path) for path in DOCUMENTS}
TRAINING = re.compile(r"(shardkit train|scripts/train\.py)")


def user_env() -> dict[str, str]:
    """A user's environment: no simulated-device flags from this test process (only the tests' compile flags)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = TEST_XLA_FLAGS
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture
def workdir(tmp_path):
    """A directory like the repository's root, with real text for ``--data my_text.txt``."""
    for name in ("examples", "scripts", "tests"):  # tests/: the reference checkpoints under tests/fixtures
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "my_text.txt").write_text((ROOT / "docs" / "architecture.md").read_text() * 4)
    return tmp_path


def commands(block: str) -> list[str]:
    """The block's shell commands: continuations joined, ``[optional]`` parts and comments dropped."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s#.*$|^#.*$", "", line)
        line = re.sub(r"\[[^\]]*\]", "", line).strip()
        if line:
            out.append(line)
    return out


def smaller(command: str) -> str:
    """The reductions the README states: 3 training steps, 1 compiled layout in the planner."""
    if "scripts/train.py" in command:  # the library example takes key=value settings
        command = re.sub(r"\ssteps=\d+", "", command) + " steps=3"
    elif TRAINING.search(command):
        command = re.sub(r"\s--steps\s+\d+", "", command) + " --steps 3"
    if command.startswith("shardkit plan"):
        command += " --compile-top 1"
    return command


def run(command: str, cwd: pathlib.Path, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{command!r} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def blocks_of(language: str, document: str = "README.md") -> list[tuple[str, int]]:
    return [(text, line) for lang, text, line in BLOCKS[document] if lang == language]


def every_block(language: str) -> list[tuple[str, int]]:
    """``(document, index)`` of each block of ``language`` in every document (the README's two
    set-up blocks aside: CI runs those)."""
    return [
        (doc, i)
        for doc in BLOCKS
        for i in range(len(blocks_of(language, doc)))
        if not (doc == "README.md" and language == "bash" and i < 2)
    ]


def test_the_documents_have_only_blocks_this_test_runs():
    for doc, blocks in BLOCKS.items():
        assert {lang for lang, _, _ in blocks} <= {"python", "bash", ""}, doc
        assert doc == "README.md" or "" not in {lang for lang, _, _ in blocks}, f"{doc}: name each block's language"
    assert len(blocks_of("python")) >= 1 and len(blocks_of("bash")) >= 2
    assert len(every_block("python")) >= 4 and len(every_block("bash")) >= 3


def test_every_relative_link_leads_to_a_file():
    for path in [*DOCUMENTS, ROOT / "docs" / "architecture.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", path.read_text()):
            if "://" not in target:
                where = path.relative_to(ROOT)
                assert (path.parent / target).exists(), f"{where} links to {target}, which does not exist"


def test_the_readme_stays_short():
    assert (ROOT / "README.md").read_text().count("\n") <= 210, "move the detail to a guide in docs/guides/"


@pytest.mark.parametrize("document,index", every_block("python"), ids=lambda x: str(x))
def test_python_block_runs(document, index, workdir):
    text, line = blocks_of("python", document)[index]
    script = workdir / f"{pathlib.Path(document).stem}_block_line_{line}.py"
    script.write_text(text)
    run(f"{sys.executable} {script.name}", workdir)


@pytest.mark.slow
def test_the_setup_blocks_are_what_ci_runs(workdir):
    main_job, test_command = (text.strip() for text, _ in blocks_of("bash")[:2])
    ci = (ROOT / ".ci" / "run").read_text()
    assert main_job.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && ")
    assert test_command.startswith('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]"')
    assert 'pip install --quiet -e ".[test]"' in ci and "python3 -m venv" in ci
    assert f"\n{test_command.split(' && ')[-1]} " in ci or ci.rstrip().endswith(test_command.split(" && ")[-1])
    # The main job itself, in this environment (the install is the one above).
    proc = run(smaller(main_job.split(" && ")[-1]), workdir)
    assert "summary: 3 steps on 8 cpu device(s)" in proc.stdout
    assert "MFU n/a (cpu has no published peak" in proc.stdout  # no invented figure on a CPU


@pytest.mark.slow
@pytest.mark.parametrize("document,index", every_block("bash"), ids=lambda x: str(x))
def test_shell_block_runs(document, index, workdir):
    text, _ = blocks_of("bash", document)[index]
    for command in map(smaller, commands(text)):
        if command.startswith("shardkit launch") and "--nnodes 2" in command:
            two_nodes_here(command, workdir)
        else:
            run(command, workdir)


def two_nodes_here(command: str, workdir: pathlib.Path) -> None:
    """Both nodes of a two-node launch on this machine, one process each, on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = re.sub(r"--coordinator\s+\S+", f"--coordinator 127.0.0.1:{port}", command)
    command = re.sub(r"--nproc\s+\d+", "--nproc 1", command)
    other = command.replace("--node-rank 0", "--node-rank 1")
    assert other != command, "the README's two-node example names --node-rank 0"
    node1 = subprocess.Popen(["bash", "-c", other], cwd=workdir, env=user_env(), stdout=subprocess.PIPE, text=True)
    try:
        run(command, workdir)
        assert node1.wait(timeout=300) == 0
    finally:
        if node1.poll() is None:
            node1.kill()


def test_the_file_tree_names_real_files():
    (tree,) = [text for text, _ in blocks_of("")]
    ours = [p for top in ("shardkit", "examples") for p in (ROOT / top).rglob("*.py")]
    for name in re.findall(r"\b([\w/]+\.py)\b", tree):
        assert any(str(p).endswith(f"/{name}") for p in ours), f"README's file tree names {name}, which does not exist"
