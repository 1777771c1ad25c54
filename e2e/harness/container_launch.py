"""How one container of a pod becomes a local process: its command line, environment and directories.

The container's ``command`` + ``args`` and ``env`` are taken as the pod template gives them, with
Kubernetes' ``$(VAR)`` expansion, and translated only where a process on this machine cannot have what a
container has:

- **network namespace**: a container's servers listen on 0.0.0.0 inside the pod; here every pod shares
  the host's, so the process is told to listen on the pod's own loopback address (``--host <pod IP>``,
  the flag both kvpilot servers take; an existing wildcard ``--host`` value is replaced). Ports stay the
  template's: each pod has its own address, so two pods' port 8000 never meet.
- **volumes**: an ``emptyDir`` is a directory under the pod's directory; a path in ``env`` values,
  ``args`` or ``workingDir`` that lies under its ``mountPath`` is rewritten to it. Other volume types are
  refused (``UnsupportedPod``), as are ``envFrom`` and ``valueFrom`` other than ``secretKeyRef`` (no
  ConfigMaps or downward API).
- **Secrets**: the kubelet loop (``workloads``) replaces each ``valueFrom.secretKeyRef`` with the stored
  Secret's value (``resolve_secret_env``) before the pod's containers start; a Secret or key that is not
  there yet holds the pod back until it is, as a kubelet retries a container it cannot configure.
- **image**: there is none; the image's environment is emulated as this interpreter's ``bin`` directory
  first on ``PATH`` (where ``kvpilot`` is installed) plus ``PYTHONUNBUFFERED=1``, like the Dockerfile's.
- **service account**: ``KUBECONFIG`` points at the harness API server (a pod would read its mounted
  token and ``KUBERNETES_SERVICE_HOST``; the kubernetes client falls back to the kubeconfig).
"""

from __future__ import annotations

import base64
import binascii
import copy
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.probes import UnsupportedPod

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: Path


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' variable expansion: ``$(NAME)`` from env if defined (else kept), ``$$`` is a ``$``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(replace, value)


class MissingSecret(Exception):
    """A container's env names a Secret (or key) that does not exist yet: the pod cannot start now."""


def _secret_value(secret: dict[str, Any], key: str) -> str | None:
    if key in secret.get("data", {}):
        try:
            return base64.b64decode(secret["data"][key], validate=True).decode("utf-8", errors="replace")
        except (binascii.Error, TypeError) as error:
            raise MissingSecret(f"key {key!r} of the Secret is not base64: {error}") from None
    # a real API server folds stringData into data on write; the harness stores what it was sent
    value = secret.get("stringData", {}).get(key)
    return value if isinstance(value, str) else None


def resolve_secret_env(
    pod: dict[str, Any], secret_of: Callable[[str, str], dict[str, Any] | None]
) -> dict[str, Any]:
    """The pod with each ``env[].valueFrom.secretKeyRef`` turned into a plain ``value``, read through
    ``secret_of(namespace, name)``; ``MissingSecret`` names the first Secret or key that is absent (an
    ``optional`` one is left out instead). Other ``valueFrom`` sources stay, for ``build_launch`` to
    refuse."""
    resolved = copy.deepcopy(pod)
    namespace = pod["metadata"].get("namespace", "default")
    for container in [*resolved["spec"].get("initContainers", []), *resolved["spec"].get("containers", [])]:
        env = []
        for variable in container.get("env", []):
            ref = variable.get("valueFrom", {}).get("secretKeyRef")
            if ref is None:
                env.append(variable)
                continue
            secret = secret_of(namespace, ref.get("name", ""))
            value = _secret_value(secret, ref.get("key", "")) if secret is not None else None
            if value is None:
                if ref.get("optional"):
                    continue
                what = (
                    f'secret "{ref.get("name")}"'
                    if secret is None
                    else f'key "{ref.get("key")}" in secret "{ref.get("name")}"'
                )
                raise MissingSecret(
                    f"container {container['name']!r} env {variable['name']!r}: {what} not found"
                )
            env.append({"name": variable["name"], "value": value})
        if "env" in container:
            container["env"] = env
    return resolved


def empty_dirs(pod: dict[str, Any], pod_dir: Path) -> dict[str, Path]:
    """Volume name -> its directory, for the pod's emptyDir volumes (created here)."""
    dirs = {}
    for volume in pod["spec"].get("volumes", []):
        if "emptyDir" in volume:
            dirs[volume["name"]] = pod_dir / "volumes" / volume["name"]
            dirs[volume["name"]].mkdir(parents=True, exist_ok=True)
    return dirs


def _mounts(
    container: dict[str, Any], volumes: dict[str, Path], pod: dict[str, Any]
) -> list[tuple[str, Path]]:
    """(mountPath, host directory) of each mount, longest path first so nested mounts win."""
    kinds = {v["name"]: next((k for k in v if k != "name"), "?") for v in pod["spec"].get("volumes", [])}
    mounts = []
    for mount in container.get("volumeMounts", []):
        name = mount["name"]
        if name not in volumes:
            raise UnsupportedPod(
                f"container {container['name']!r} mounts volume {name!r} "
                f"({kinds.get(name, 'undeclared')}); only emptyDir volumes are emulated"
            )
        target = volumes[name] / mount.get("subPath", "")
        target.mkdir(parents=True, exist_ok=True)
        mounts.append((mount["mountPath"].rstrip("/") or "/", target))
    return sorted(mounts, key=lambda m: len(m[0]), reverse=True)


def _translate_path(value: str, mounts: list[tuple[str, Path]]) -> str:
    for mount_path, host_dir in mounts:
        if value == mount_path or value.startswith(mount_path + "/"):
            return str(host_dir) + value[len(mount_path) :]
    return value


def _listen_on(args: list[str], pod_ip: str) -> list[str]:
    for index, arg in enumerate(args[:-1]):
        if arg == "--host":
            if args[index + 1] in WILDCARD_HOSTS:
                return [*args[: index + 1], pod_ip, *args[index + 2 :]]
            return args
        if arg.startswith("--host="):
            value = arg.split("=", 1)[1]
            return (
                args
                if value not in WILDCARD_HOSTS
                else [*args[:index], f"--host={pod_ip}", *args[index + 1 :]]
            )
    return [*args, "--host", pod_ip]


def image_env(pod_name: str, kubeconfig: Path) -> dict[str, str]:
    """What the image and the kubelet give every container before the template's own env."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
    return {"PATH": path, "PYTHONUNBUFFERED": "1", "HOSTNAME": pod_name, "KUBECONFIG": str(kubeconfig)}


def build_launch(
    pod: dict[str, Any], container: dict[str, Any], pod_dir: Path, volumes: dict[str, Path], kubeconfig: Path
) -> LaunchSpec:
    """The process for ``container``; ``UnsupportedPod`` names the first field that cannot be emulated."""
    name = container["name"]
    if "envFrom" in container:
        raise UnsupportedPod(f"container {name!r}: envFrom is not emulated")
    if not container.get("command"):
        raise UnsupportedPod(f"container {name!r}: no command (there is no image whose entrypoint to run)")
    mounts = _mounts(container, volumes, pod)
    env = image_env(pod["metadata"]["name"], kubeconfig)
    for variable in container.get("env", []):
        if "valueFrom" in variable:
            raise UnsupportedPod(f"container {name!r} env {variable['name']!r}: valueFrom is not emulated")
        env[variable["name"]] = _translate_path(expand(variable.get("value", ""), env), mounts)
    command = [expand(part, env) for part in container["command"]]
    args = [_translate_path(expand(arg, env), mounts) for arg in container.get("args", [])]
    executable = command[0] if os.sep in command[0] else shutil.which(command[0], path=env["PATH"])
    if executable is None:
        # what the runtime reports; the container then fails to start (StartError) and backs off
        executable = command[0]
    working_dir = container.get("workingDir")
    cwd = Path(_translate_path(working_dir, mounts)) if working_dir else pod_dir
    if working_dir and not cwd.is_relative_to(pod_dir):
        raise UnsupportedPod(f"container {name!r}: workingDir {working_dir!r} is not on an emptyDir volume")
    ports = container.get("ports", [])
    argv = [executable, *command[1:], *(_listen_on(args, pod["status"]["podIP"]) if ports else args)]
    return LaunchSpec(argv=argv, env=env, cwd=cwd)
