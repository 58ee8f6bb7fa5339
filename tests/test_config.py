"""hoccl.Config: every setting in one frozen object, checked once, read from the
environment in one place, and what init_local, split_local, set_options take and
``comm.config`` shows."""

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

import hoccl
from hoccl.config import ACROSS_HOSTS, ENVIRONMENT, SETTINGS, Config

#: a valid value other than the default, per setting
OTHER = {"timeout": 42.0, "verify_plans": True, "max_sms": 12, "copy_sms": 3, "fuse_sums": False,
         "copy_lanes": 2, "chunk_bytes": 1 << 20, "self_route": "peer", "one_shot_bytes": 4096,
         "pull_bytes": 8192, "kernel_bytes": 2048, "kernel_sms": 4, "intra_host": "torch",
         "phases": "sequential", "phase_bytes": 1 << 16, "stage_bytes": 1 << 18}
BAD = {"timeout": 0, "verify_plans": "yes", "max_sms": 0, "copy_sms": -1, "fuse_sums": 2,
       "copy_lanes": 0, "chunk_bytes": 0, "self_route": "sideways", "one_shot_bytes": -1,
       "pull_bytes": 1.5, "kernel_bytes": True, "kernel_sms": 10 ** 6, "intra_host": "rocm",
       "phases": "overlapped", "phase_bytes": 0, "stage_bytes": -4}


def test_every_setting_has_a_valid_and_a_bad_value_here():
    assert set(OTHER) == set(BAD) == set(SETTINGS)


def test_config_is_frozen_and_its_plan_options_follow_it():
    config = Config(kernel_bytes=2048, chunk_bytes=1 << 20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kernel_bytes = 0  # type: ignore[misc]
    assert config.plan_options.kernel_bytes == 2048 and config.plan_options.chunk_bytes == 1 << 20
    assert config.replace(max_sms=4).max_sms == 4 and config.max_sms == 8


@pytest.mark.parametrize("name", SETTINGS)
def test_a_bad_value_is_refused_naming_the_call_and_the_setting(name):
    with pytest.raises(hoccl.InvalidArgumentError, match=f"^init_local: {name} "):
        Config.make("init_local", None, {name: BAD[name]})
    with pytest.raises(hoccl.InvalidArgumentError, match=f"^{name} "):
        Config(**{name: BAD[name]})


def test_an_unknown_setting_is_refused_with_the_known_ones():
    with pytest.raises(hoccl.InvalidArgumentError,
                       match=r"^set_options: unknown settings \['kernel_byte'\]; expected any of"):
        Config().replace("set_options", kernel_byte=1)


def test_the_environment_gives_what_the_call_does_not(monkeypatch):
    monkeypatch.setenv("HOCCL_KERNEL_BYTES", "4K")
    monkeypatch.setenv("HOCCL_CHUNK_BYTES", "2M")
    monkeypatch.setenv("HOCCL_FUSE_SUMS", "off")
    monkeypatch.setenv("HOCCL_TIMEOUT", "12.5")
    config = Config.from_environment("init", {"chunk_bytes": 1 << 16, "max_sms": None})
    assert (config.kernel_bytes, config.chunk_bytes, config.fuse_sums, config.timeout,
            config.max_sms) == (4096, 1 << 16, False, 12.5, 8)
    monkeypatch.setenv("HOCCL_KERNEL_SMS", "many")
    with pytest.raises(hoccl.InvalidArgumentError, match="^init: HOCCL_KERNEL_SMS must be an int"):
        Config.from_environment("init")


def test_init_local_takes_a_config_and_keywords_override_it():
    comms = hoccl.init_local(2, backend="host", config=Config(kernel_bytes=2048, max_sms=5),
                             max_sms=6)
    try:
        for comm in comms:
            assert comm.config == Config(kernel_bytes=2048, max_sms=6, copy_sms=16, fuse_sums=True)
            assert comm.options.kernel_bytes == 2048 and comm.max_sms == 6
    finally:
        for comm in comms:
            comm.close()


@pytest.mark.parametrize("name", [name for name in SETTINGS if name not in ACROSS_HOSTS])
def test_set_options_takes_every_setting_and_a_bad_one_changes_nothing(name):
    comms = hoccl.init_local(2, backend="host")
    try:
        before = comms[0].config
        other = "kernel_sms" if name != "kernel_sms" else "chunk_bytes"
        with pytest.raises(hoccl.InvalidArgumentError, match=f"^set_options: {name} "):
            comms[0].set_options(**{name: BAD[name], other: OTHER[other]})
        assert comms[0].config == before
        for comm in comms:
            comm.set_options(**{name: OTHER[name]})
        assert comms[0].config == before.replace(**{name: OTHER[name]})
        # and the communicators still compute exactly with it
        rng = np.random.default_rng()
        sends = [rng.integers(-9, 9, 37).astype(np.float32) for _ in comms]
        recvs = [np.full(37, np.nan, np.float32) for _ in comms]
        with hoccl.group():
            for comm, send, recv in zip(comms, sends, recvs):
                comm.all_reduce(send, recv)
        for comm in comms:
            comm.synchronize()
        for recv in recvs:
            np.testing.assert_array_equal(recv, sends[0] + sends[1])
    finally:
        for comm in comms:
            comm.close()


@pytest.mark.parametrize("name", ACROSS_HOSTS)
def test_a_communicator_of_one_host_checks_the_settings_across_hosts(name):
    comms = hoccl.init_local(2, backend="host")
    try:
        before = comms[0].config
        with pytest.raises(hoccl.InvalidArgumentError, match=f"^set_options: {name} "):
            comms[0].set_options(**{name: BAD[name]})
        assert comms[0].config == before
    finally:
        for comm in comms:
            comm.close()


def test_the_settings_across_hosts_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("HOCCL_INTRA_HOST", "torch")
    monkeypatch.setenv("HOCCL_PHASES", "Sequential")
    monkeypatch.setenv("HOCCL_PHASE_BYTES", "64K")
    config = Config.from_environment("init")
    assert (config.intra_host, config.phases, config.phase_bytes) == ("torch", "sequential",
                                                                      1 << 16)
    monkeypatch.setenv("HOCCL_INTRA_HOST", "auto")
    assert Config.from_environment("init").intra_host is None


def test_split_local_inherits_the_parents_config_with_its_overrides():
    parents = hoccl.init_local(3, backend="host", kernel_bytes=1024, chunk_bytes=1 << 18)
    try:
        children = hoccl.split_local(parents, [0, 0, 1], kernel_sms=2)
        try:
            for child in children:
                assert child is not None
                want = parents[0].config.replace(kernel_sms=2,
                                                 copy_sms=hoccl.default_copy_sms(3))
                assert child.config == want
        finally:
            for child in children:
                if child is not None:
                    child.close()
    finally:
        for comm in parents:
            comm.close()


def test_every_hoccl_environment_variable_is_read_through_config_environ():
    """The environment is read in one place: no library module but hoccl/config.py reads a
    HOCCL_ variable itself, and every variable named in the library is listed."""
    root = Path(hoccl.__file__).parent
    direct = re.compile(r"os\.environ(?:\.get)?[\[(]\s*[\"']HOCCL_")
    named = re.compile(r"[\"'](HOCCL_[A-Z_]+)[\"']")
    offenders, unlisted = [], set()
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if path.name != "config.py" and direct.search(text):
            offenders.append(str(path.relative_to(root)))
        if path.name != "_kernels.py":  # its HOCCL_ names are the kernels' macros
            unlisted |= {name for name in named.findall(text) if name not in ENVIRONMENT}
    assert not offenders, offenders
    assert not unlisted, sorted(unlisted)
