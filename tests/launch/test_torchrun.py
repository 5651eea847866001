"""`python -m services.launch.torchrun`: a learner of two ranks that stops cleanly, fails loudly and
never outlives its launcher. Real torchrun, real ranks (Gloo), real signals, found and sent by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc

LIMIT_S = 120  # a hard bound per wait: the test can never hang CI


def _launch(model: Path, tmp_path: Path, name: str, rendezvous: list[str]) -> tuple[subprocess.Popen, Path]:
    """One torchrun (our wrapper) of the learner with `rendezvous` options; its port file and log."""
    port_file, log = tmp_path / f"{name}.port", tmp_path / f"{name}.log"
    command = [
        sys.executable, "-m", "services.launch.torchrun", *rendezvous, "--max-restarts", "0",
        "-m", "services.learner", "--model", str(model), "--device", "cpu",
        "--port", "0", "--port-file", str(port_file), "--checkpoint.dir", str(tmp_path / "checkpoints"),
    ]  # fmt: skip
    with log.open("w") as out:
        launcher = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return launcher, log


def _serving(launcher: subprocess.Popen, port_file: Path, log: Path) -> str:
    started = time.monotonic()
    while not (port_file.exists() and port_file.read_text().strip()):
        assert launcher.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() - started < LIMIT_S, "the learner did not start"
        time.sleep(0.2)
    return f"127.0.0.1:{port_file.read_text().strip()}"


def _start(model: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    launcher, log = _launch(model, tmp_path, "learner", ["--standalone", "--nproc-per-node", "2"])
    _serving(launcher, tmp_path / "learner.port", log)
    return launcher, log


def _ranks(launcher: subprocess.Popen) -> dict[str, psutil.Process]:
    found = {}
    for process in psutil.Process(launcher.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "services.learner" in process.cmdline() and "RANK" in process.environ():
                found[process.environ()["RANK"]] = process
    return found


@pytest.fixture
def cleanup():
    launched: list[subprocess.Popen] = []
    seen: list[psutil.Process] = []
    yield launched, seen
    for launcher in launched:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    for process in seen:
        with contextlib.suppress(psutil.Error):
            process.kill()


def test_sigterm_stops_every_rank_cleanly(tiny_model_dir: Path, tmp_path: Path, cleanup) -> None:
    launcher, log = _start(tiny_model_dir, tmp_path)
    cleanup[0].append(launcher)
    ranks = _ranks(launcher)
    cleanup[1].extend(ranks.values())
    assert sorted(ranks) == ["0", "1"]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=LIMIT_S) == 0, log.read_text()[-4000:]  # torchrun alone would exit 1
    output = log.read_text()
    assert '"event": "stopped", "service": "learner"' in output
    assert "SIGTERM: stopping when rank 0 says so" in output
    _, alive = psutil.wait_procs(list(ranks.values()), timeout=10)
    assert not alive


def test_a_killed_rank_takes_the_learner_down(tiny_model_dir: Path, tmp_path: Path, cleanup) -> None:
    launcher, log = _start(tiny_model_dir, tmp_path)
    cleanup[0].append(launcher)
    ranks = _ranks(launcher)
    cleanup[1].extend(ranks.values())
    ranks["1"].send_signal(signal.SIGKILL)
    assert launcher.wait(timeout=LIMIT_S) != 0, log.read_text()[-4000:]
    _, alive = psutil.wait_procs(list(ranks.values()), timeout=10)
    assert not alive


def test_the_ranks_die_with_the_launcher(tiny_model_dir: Path, tmp_path: Path, cleanup) -> None:
    launcher, _ = _start(tiny_model_dir, tmp_path)
    cleanup[0].append(launcher)
    everything = psutil.Process(launcher.pid).children(recursive=True)
    cleanup[1].extend(everything)
    launcher.send_signal(signal.SIGKILL)  # torchrun gets SIGKILL, the ranks SIGTERM: rank 0 stops them
    _, alive = psutil.wait_procs(everything, timeout=LIMIT_S)
    assert not alive, alive


def test_two_hosts_rendezvous_at_the_first(tiny_model_dir: Path, tmp_path: Path, cleanup) -> None:
    """The multi-host command of docs/distributed-learner.md on one machine: two torchruns, one rank
    each (`--nnodes 2 --node-rank K`), meeting at a static rendezvous on the first "host"'s address.
    Rank 0 serves a learner of two sharded ranks and trains; both hosts stop cleanly on SIGTERM."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        master_port = probe.getsockname()[1]
    hosts = []
    for node in ("0", "1"):
        rendezvous = ["--nnodes", "2", "--node-rank", node, "--nproc-per-node", "1",
                      "--master-addr", "127.0.0.1", "--master-port", str(master_port)]  # fmt: skip
        hosts.append(_launch(tiny_model_dir, tmp_path, f"host{node}", rendezvous))
        cleanup[0].append(hosts[-1][0])
    address = _serving(hosts[0][0], tmp_path / "host0.port", hosts[0][1])
    assert not (tmp_path / "host1.port").exists()  # only rank 0 serves
    for launcher, _ in hosts:
        cleanup[1].extend(psutil.Process(launcher.pid).children(recursive=True))
    with grpc.insecure_channel(address) as channel:
        stub = learner_pb2_grpc.LearnerServiceStub(channel)
        state = stub.GetLearnerState(learner_pb2.GetLearnerStateRequest(), timeout=LIMIT_S)
        assert (state.ranks, state.sharded, state.step) == (2, True, 0)
        batch = types_pb2.TrainBatch(batch_id="b0", step=0)
        group = batch.groups.add(group_id="g0")
        for completion in ([5, 6, 7], [8, 9]):
            group.completions.add(prompt_token_ids=[1, 2, 3], completion_token_ids=completion,
                                  logprobs=[-5.0] * len(completion),
                                  sampling_params=types_pb2.SamplingParams(temperature=1.0, n=2))  # fmt: skip
        group.rewards.extend([1.0, 0.0])
        group.advantages.extend([1.0, -1.0])
        result = stub.TrainStep(learner_pb2.TrainStepRequest(batch=batch), timeout=LIMIT_S).result
        assert (result.step, result.weight_version) == (1, 1)
        assert result.metrics["grad_norm"] > 0
    for launcher, _ in hosts:
        launcher.send_signal(signal.SIGTERM)
    for launcher, log in hosts:
        assert launcher.wait(timeout=LIMIT_S) == 0, log.read_text()[-4000:]
