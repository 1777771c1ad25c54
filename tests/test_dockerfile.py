"""The Dockerfile's stages, read without a Docker engine: the stage each image (VARIANT=cuda, VARIANT=cpu)
is built from must carry a C compiler (Triton builds its launcher at the first kernel launch; the CPU
engine compiles its fused C kernels with ``cc``) and the Python headers of the interpreter the venv runs
(Triton's launcher includes ``Python.h``), run as a non-root user, and the CUDA base must not duplicate
the CUDA libraries torch's cu128 wheels already install.

The parser covers what this Dockerfile uses: global ``ARG`` defaults substituted into ``FROM``, ``FROM
image [AS name]``, line continuations (with comment lines inside them, which Docker drops), ``RUN``,
``COPY --from`` and ``USER``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[1] / "Dockerfile"
#: apt packages that put a C compiler (``cc``/``gcc``) on PATH
COMPILER_PACKAGES = re.compile(r"^(gcc(-\d+)?|build-essential|clang(-\d+)?)$")
#: official python images install CPython, headers included, under /usr/local (include/pythonX.Y)
PYTHON_IMAGE = re.compile(r"^(docker\.io/)?(library/)?python:(?P<version>\d+\.\d+)")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def commands(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def logical_lines(text: str) -> list[str]:
    """Instructions one per line: continuations joined, comments and blank lines dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # inside a continuation too: Docker removes comment lines before joining
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    if pending:
        lines.append(pending.rstrip())
    return lines


def _substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), value)


def parse(text: str, build_args: dict[str, str] | None = None) -> list[Stage]:
    """The stages in order, each ``FROM`` resolved with the global ARG defaults and ``build_args``."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines(text):
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--platform")]
            base = _substitute(words[0], {**global_args, **(build_args or {})})
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, base))
        elif not stages:
            if keyword == "ARG":
                arg_name, _, default = args.partition("=")
                global_args[arg_name] = default.strip('"')
        else:
            stages[-1].instructions.append((keyword, args))
    return stages


def image_chain(stages: list[Stage]) -> list[Stage]:
    """The final stage and the stages it is built on, down to the one whose base is an external image."""
    by_name = {stage.name: stage for stage in stages}
    chain = [stages[-1]]
    while chain[-1].base in by_name:
        chain.append(by_name[chain[-1].base])
    return chain


def apt_packages(stage: Stage) -> set[str]:
    """Packages named by ``apt-get install`` / ``apt install`` in the stage's RUN commands."""
    packages: set[str] = set()
    for command in stage.commands("RUN"):
        for segment in re.split(r"&&|\|\||;|\|", command):
            words = shlex.split(segment)
            tool = next((i for i, w in enumerate(words) if w in ("apt-get", "apt")), None)
            if tool is not None and "install" in words[tool:]:
                start = words.index("install", tool) + 1
                packages |= {w.split("=")[0] for w in words[start:] if not w.startswith("-")}
    return packages


def external_base(stage_name: str, stages: list[Stage]) -> str:
    """The external image a stage is built on, through the stages it names."""
    by_name = {stage.name: stage for stage in stages}
    base = by_name[stage_name].base
    while base in by_name:
        base = by_name[base].base
    return base


def copy_sources(stage: Stage) -> list[tuple[str | None, list[str], str]]:
    """Each COPY as (``--from`` stage or None, source paths, destination)."""
    copies = []
    for copy in stage.commands("COPY"):
        words = copy.split()
        source = next((w.removeprefix("--from=") for w in words if w.startswith("--from=")), None)
        paths = [w for w in words if not w.startswith("--")]
        copies.append((source, paths[:-1], paths[-1]))
    return copies


def has_c_compiler(chain: list[Stage]) -> bool:
    if "-devel" in chain[-1].base:  # nvidia/cuda *-devel images carry gcc (nvcc's host compiler)
        return True
    return any(COMPILER_PACKAGES.match(pkg) for stage in chain for pkg in apt_packages(stage))


def python_header_versions(chain: list[Stage], stages: list[Stage]) -> set[str]:
    """Python versions whose headers the final image has: an official python base, /usr/local copied
    from a stage on one, or ``pythonX.Y-dev`` installed."""
    versions: set[str] = set()
    if match := PYTHON_IMAGE.match(chain[-1].base):
        versions.add(match["version"])
    for stage in chain:
        for source, paths, _ in copy_sources(stage):
            copies_include = any(p.rstrip("/") in ("/usr/local", "/usr/local/include") for p in paths)
            if (
                source is not None
                and copies_include
                and (match := PYTHON_IMAGE.match(external_base(source, stages)))
            ):
                versions.add(match["version"])
        versions |= {
            m[1] for pkg in apt_packages(stage) if (m := re.match(r"^(?:lib)?python(\d+\.\d+)-dev$", pkg))
        }
    return versions


def venv_python_version(chain: list[Stage], stages: list[Stage]) -> str:
    """The Python version of the stage the final image copies its venv (/opt/kvpilot) from."""
    for stage in chain:
        for source, _, destination in copy_sources(stage):
            if destination.rstrip("/") == "/opt/kvpilot" and source is not None:
                base = external_base(source, stages)
                match = PYTHON_IMAGE.match(base)
                assert match, (
                    f"the venv comes from stage {source!r}, based on {base}, not an official python image"
                )
                return match["version"]
    raise AssertionError("the final image copies no venv into /opt/kvpilot")


def stages_for(variant: str) -> list[Stage]:
    return parse(DOCKERFILE.read_text(), {"VARIANT": variant})


# --- the parser, on Dockerfiles small enough to check by eye ------------------------------------------------

OLD_LAYOUT = """\
ARG VARIANT=cuda
FROM python:3.11.13-slim-bookworm AS build
RUN python -m venv /opt/kvpilot
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS runtime-cuda
RUN apt-get update \\
    && apt-get install -y --no-install-recommends ca-certificates libssl3t64 \\
# a comment inside a continuation, dropped as Docker drops it
       libffi8 zlib1g \\
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local /usr/local
FROM python:3.11.13-slim-bookworm AS runtime-cpu
FROM runtime-${VARIANT} AS final
COPY --from=build /opt/kvpilot /opt/kvpilot
USER 10001:10001
"""


def test_the_parser_reads_stages_arg_defaults_build_args_and_continuations():
    stages = parse(OLD_LAYOUT)
    assert [(s.name, s.base) for s in stages] == [
        ("build", "python:3.11.13-slim-bookworm"),
        ("runtime-cuda", "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"),
        ("runtime-cpu", "python:3.11.13-slim-bookworm"),
        ("final", "runtime-cuda"),
    ]
    assert apt_packages(stages[1]) == {"ca-certificates", "libssl3t64", "libffi8", "zlib1g"}
    assert [s.name for s in image_chain(stages)] == ["final", "runtime-cuda"]
    assert [s.name for s in image_chain(parse(OLD_LAYOUT, {"VARIANT": "cpu"}))] == ["final", "runtime-cpu"]


def test_the_checks_fail_a_runtime_without_a_compiler_and_pass_a_devel_base_or_gcc():
    cuda = parse(OLD_LAYOUT)
    assert not has_c_compiler(image_chain(cuda))
    assert not has_c_compiler(image_chain(parse(OLD_LAYOUT, {"VARIANT": "cpu"})))
    assert has_c_compiler(image_chain(parse(OLD_LAYOUT.replace("cudnn-runtime", "cudnn-devel"))))
    assert has_c_compiler(image_chain(parse(OLD_LAYOUT.replace("zlib1g", "zlib1g gcc libc6-dev"))))
    assert python_header_versions(image_chain(cuda), cuda) == {"3.11"}
    without_usr_local = OLD_LAYOUT.replace("COPY --from=build /usr/local /usr/local\n", "")
    assert python_header_versions(image_chain(parse(without_usr_local)), parse(without_usr_local)) == set()


# --- the Dockerfile itself ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["cuda", "cpu"])
def test_each_image_is_built_on_its_runtime_stage(variant):
    assert [s.name for s in image_chain(stages_for(variant))] == ["final", f"runtime-{variant}"]


@pytest.mark.parametrize("variant", ["cuda", "cpu"])
def test_the_runtime_stage_has_a_c_compiler(variant):
    chain = image_chain(stages_for(variant))
    assert has_c_compiler(chain), (
        f"the {variant} image has no C compiler: Triton builds its launcher with one at the first kernel "
        "launch, and the CPU engine compiles its C kernels with cc; apt-get install gcc libc6-dev"
    )
    # gcc's C library headers are only a Recommends, which --no-install-recommends skips
    assert "-devel" in chain[-1].base or any("libc6-dev" in apt_packages(stage) for stage in chain)


@pytest.mark.parametrize("variant", ["cuda", "cpu"])
def test_the_python_headers_of_the_venvs_interpreter_are_in_the_image(variant):
    stages = stages_for(variant)
    chain = image_chain(stages)
    assert venv_python_version(chain, stages) == "3.11"
    assert "3.11" in python_header_versions(chain, stages)


def test_the_cuda_base_carries_no_cuda_libraries_the_torch_wheels_bring():
    base = image_chain(stages_for("cuda"))[-1].base
    assert base.startswith("nvidia/cuda:12.8.") and re.search(r"-base-ubuntu\d+\.\d+$", base), base


@pytest.mark.parametrize("variant", ["cuda", "cpu"])
def test_the_image_runs_as_a_non_root_user(variant):
    # the effective user is the last USER of the nearest stage (final first) that sets one
    users = next(
        (stage.commands("USER") for stage in image_chain(stages_for(variant)) if stage.commands("USER")), []
    )
    assert users, "no USER instruction: the image would run as root"
    assert users[-1].split(":")[0] not in ("0", "root")
