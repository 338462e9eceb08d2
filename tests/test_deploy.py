"""The deploy files as far as they can be checked without Docker: one pinned dependency set for CI and the image,
an image that compiles the int8 kernel, and a compose example whose commands parse and whose replicas can average."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import re
import shlex
import sys

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO
from geotrain.cli import build_parser

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEPLOY = REPO / "deploy"


def _pins(path) -> dict[str, str]:
    """name -> pinned version of a requirements file, following `-r` includes."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            pins.update(_pins(path.parent / line[3:].strip()))
        elif line:
            name, sep, version = line.partition("==")
            assert sep and version, f"{path.name}: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = version
    return pins


def _declared(extra: str | None = None) -> list[Requirement]:
    """pyproject.toml's dependencies (or an extra's) that apply to this Python."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return [r for r in map(Requirement, listed) if r.marker is None or r.marker.evaluate()]


@pytest.mark.parametrize("extra, file", [(None, "requirements.txt"), ("dev", "requirements-dev.txt")])
def test_pins_cover_what_pyproject_declares(extra, file):
    pins = _pins(DEPLOY / file)
    for requirement in _declared(extra):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{file} does not pin {name}"
        assert requirement.specifier.contains(pins[name]), f"{file} pins {name}=={pins[name]} outside {requirement}"
    # The coordinator cannot start without these two; the image once left them out.
    assert {"aiohttp", "prometheus-client"} <= _pins(DEPLOY / "requirements.txt").keys()


def test_this_environment_is_the_pinned_one():
    for name, version in _pins(DEPLOY / "requirements-dev.txt").items():
        # torch's local version (+cpu) names its build, not another release.
        assert importlib.metadata.version(name).split("+")[0] == version, name


def test_makefile_installs_the_pins_file_and_pins_nothing_itself():
    makefile = (REPO / "Makefile").read_text()
    assert "pip install -q -r deploy/requirements-dev.txt" in makefile
    assert not re.search(r"[\w-]+==\d", makefile), "a version pinned in the Makefile, beside deploy/requirements*.txt"


def test_dockerfile_installs_the_pins_and_compiles_the_kernel():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "COPY deploy/requirements.txt /tmp/requirements.txt" in dockerfile
    assert "pip install -r /tmp/requirements.txt" in dockerfile
    # torch's version comes from the same file (the variant index only picks the build).
    assert "\"$(grep '^torch==' /tmp/requirements.txt)\"" in dockerfile
    assert not re.search(r"[\w-]+==\d", dockerfile), "a version pinned in the Dockerfile, beside requirements.txt"
    build = dockerfile.split("\nFROM ")[1]  # the build stage: the compiler and the check that the kernel was built
    assert re.search(r"apt-get install .*\bgcc\b", build)
    assert 'python -c "import geotrain.compression._blockquant"' in build
    assert "COPY --from=build /opt/venv /opt/venv" in dockerfile


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_commands_parse(compose):
    parser = build_parser()
    for name, service in compose["services"].items():
        args = parser.parse_args(shlex.split(service["command"]))
        assert args.command == ("coordinator" if name == "coordinator" else "join"), name


def test_compose_processes_advertise_their_own_ip(compose):
    # hivemind starts on the advertised host, and its /ip4/ multiaddrs take no names: nodes advertising their
    # service names ran without replica averaging.
    parser = build_parser()
    subnet = ipaddress.ip_network(compose["networks"]["run"]["ipam"]["config"][0]["subnet"])
    coordinator = parser.parse_args(shlex.split(compose["services"]["coordinator"]["command"]))
    coordinator_ip = compose["services"]["coordinator"]["networks"]["run"]["ipv4_address"]
    assert coordinator.listen.rsplit(":", 1)[0] == coordinator_ip
    nodes = {n: s for n, s in compose["services"].items() if n != "coordinator"}
    for name, service in nodes.items():
        args = parser.parse_args(shlex.split(service["command"]))
        own_ip = service["networks"]["run"]["ipv4_address"]
        assert ipaddress.ip_address(own_ip) in subnet, name
        assert args.advertise == f"{own_ip}:{args.listen.rsplit(':', 1)[1]}", name
        assert args.coordinator == f"{coordinator_ip}:{coordinator.listen.rsplit(':', 1)[1]}", name
        assert args.node_id == name


def test_compose_trains_with_replicas(compose):
    args = build_parser().parse_args(shlex.split(compose["services"]["coordinator"]["command"]))
    settings = dict(s.split("=", 1) for s in args.set)
    nodes = len(compose["services"]) - 1
    assert args.min_nodes == nodes
    assert int(settings["scheduler.stages"]) < nodes  # fewer stages than nodes: some stage has replicas
    assert settings["scheduler.placement"] == "uniform"  # every node serves (measured placement may leave spares)
    assert (DEPLOY / "configs" / args.config.rsplit("/", 1)[1]).exists()
