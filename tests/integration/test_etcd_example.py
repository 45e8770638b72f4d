"""deploy/etcd: the 3-node example configuration really forms a cluster.

The three env files are used as written, except that the example hosts
(10.0.0.11–13) become 127.0.0.1 on free ports and the data dirs go to a temp dir.
The cluster must come up healthy, replicate a write, accept writes with one member
killed (quorum 2 of 3), and etcd must not warn about any variable in the files.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path

import aetcd
import pytest

from tests.support.etcd import ETCD_BINARY, etcd_healthy, free_port
from tests.support.procs import ChildProcess
from tests.support.wait import wait_for

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "etcd"


def read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"(ETCD_[A-Z0-9_]+)=(.*)", line.strip())
        if match:
            out[match.group(1)] = match.group(2)
    return out


def localize(env: dict[str, str], ports: dict[int, dict[int, int]], data_dir: Path) -> dict:
    """Example addresses → loopback ports of this test; everything else untouched."""

    def swap(value: str) -> str:
        urls = []
        for url in value.split(","):
            if url == "http://127.0.0.1:2379":
                continue  # the loopback client URL would collide with the dev etcd
            match = re.fullmatch(r"http://10\.0\.0\.1(\d):(\d+)", url)
            if match:
                node, port = int(match.group(1)), int(match.group(2))
                url = f"http://127.0.0.1:{ports[node][port]}"
            urls.append(url)
        return ",".join(urls)

    local = {
        key: swap(value) if "URL" in key or key == "ETCD_INITIAL_CLUSTER" else value
        for key, value in env.items()
    }
    local["ETCD_INITIAL_CLUSTER"] = ",".join(
        f"{part.split('=')[0]}={swap(part.split('=', 1)[1])}"
        for part in env["ETCD_INITIAL_CLUSTER"].split(",")
    )
    local["ETCD_DATA_DIR"] = str(data_dir)
    return local


@pytest.mark.skipif(shutil.which(ETCD_BINARY) is None, reason=f"{ETCD_BINARY} not installed")
async def test_three_node_example_forms_a_cluster(tmp_path: Path) -> None:
    files = sorted(EXAMPLE.glob("etcd-*.env"))
    assert [f.name for f in files] == ["etcd-1.env", "etcd-2.env", "etcd-3.env"]
    ports = {n: {2379: free_port(), 2380: free_port(), 2381: free_port()} for n in (1, 2, 3)}
    members: list[ChildProcess] = []
    clients: list[aetcd.Client] = []
    try:
        for n, path in enumerate(files, start=1):
            env = localize(read_env(path), ports, tmp_path / f"etcd{n}")
            assert env["ETCD_NAME"] == f"etcd{n}"
            base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            members.append(
                ChildProcess(
                    [ETCD_BINARY], name=f"etcd{n}", env={**base, **env},
                    inherit_env=False, log_dir=tmp_path,
                ).start()
            )  # fmt: skip
        endpoints = [f"127.0.0.1:{ports[n][2379]}" for n in (1, 2, 3)]

        async def all_healthy() -> bool:
            results = await asyncio.gather(*(etcd_healthy(e, 2.0) for e in endpoints))
            return all(results)

        # Generous: under the full suite on 2 cores a member's first election can take
        # many 1 s election timeouts. A failure says what each member was doing.
        try:
            await wait_for(all_healthy, timeout=60, message="3 healthy etcd members")
        except AssertionError as exc:
            states = "\n".join(f"--- {m!r} running={m.running()}\n{m.tail(15)}" for m in members)
            raise AssertionError(f"{exc}\n{states}") from None
        # metrics listener from ETCD_LISTEN_METRICS_URLS answers /health too
        assert await etcd_healthy(f"127.0.0.1:{ports[1][2381]}", 1.0)

        for endpoint in endpoints:
            host, _, port = endpoint.rpartition(":")
            clients.append(aetcd.Client(host=host, port=int(port), timeout=5))
        listed = [m async for m in clients[0].members()]
        assert sorted(m.name for m in listed) == ["etcd1", "etcd2", "etcd3"]

        await clients[0].put(b"duetime-example/k", b"v1")
        got = await clients[2].get(b"duetime-example/k")
        assert got is not None and got.value == b"v1"

        members[0].kill()  # lose one member: 2 of 3 still form a quorum

        async def wrote_v2() -> bool:
            # If the killed member led raft, writes stall until the two survivors elect
            # a new leader (ELECTION_TIMEOUT 1 s, more on a loaded machine): retry.
            try:
                await asyncio.wait_for(clients[1].put(b"duetime-example/k", b"v2"), 5)
            except (aetcd.exceptions.ClientError, TimeoutError):
                return False
            return True

        await wait_for(wrote_v2, timeout=30, message="a write accepted by the 2 survivors")
        got = await clients[2].get(b"duetime-example/k")
        assert got is not None and got.value == b"v2"

        for member in members:
            log = member.output()
            assert "unrecognized environment variable" not in log, log
    finally:
        for client in clients:
            try:
                await asyncio.wait_for(client.close(), 5)
            except Exception:
                pass
        for member in members:
            member.kill()
