"""Client-side balancing over replicated fronts: a client channel spreads its calls over every
address a name resolves to (round robin), and a front with a maximum connection age makes its
clients reconnect (and so resolve again: a scale-up is seen without restarting the clients)."""

from __future__ import annotations

import time
from typing import Any

import grpc

from overworld.core.grpc_util import channel, serve

SERVICE = "overworld.test.Who"


def who_am_i(name: str) -> tuple[Any, Any, str]:
    """A registration for grpc_util.serve: /overworld.test.Who/Ask answers `name|<client peer>`."""

    def ask(request: bytes, context: grpc.ServicerContext) -> bytes:
        return f"{name}|{context.peer()}".encode()

    handler = grpc.method_handlers_generic_handler(SERVICE, {"Ask": grpc.unary_unary_rpc_method_handler(ask)})
    return (lambda _servicer, server: server.add_generic_rpc_handlers((handler,))), None, SERVICE


def ask(target: str, calls: int, pause: float = 0.0) -> list[str]:
    answers = []
    with channel(target) as ch:
        call = ch.unary_unary(f"/{SERVICE}/Ask")
        for _ in range(calls):
            answers.append(call(b"", timeout=5, wait_for_ready=True).decode())
            time.sleep(pause)
    return answers


def test_calls_are_spread_over_every_address_of_a_name() -> None:
    first = serve([who_am_i("a")], "127.0.0.1", 0)
    second = serve([who_am_i("b")], "127.0.0.2", 0)
    try:
        # Two addresses for one name, as a headless Service's DNS answer gives them.
        target = f"ipv4:127.0.0.1:{first.port},127.0.0.2:{second.port}"
        names = [answer.split("|")[0] for answer in ask(target, 20)]
        assert set(names) == {"a", "b"} and min(names.count("a"), names.count("b")) >= 5, names
        first.stop(0)
        names = [answer.split("|")[0] for answer in ask(target, 5)]
        assert names == ["b"] * 5  # the dead one's calls go to the other
    finally:
        first.stop(0)
        second.stop(0)


def test_fronts_recycle_their_connections() -> None:
    server = serve([who_am_i("front")], "127.0.0.1", 0, max_connection_age=1.0)
    try:
        peers = {answer.split("|")[1] for answer in ask(f"127.0.0.1:{server.port}", 12, pause=0.25)}
        assert len(peers) >= 2, f"one connection for 3 s with a 1 s maximum age: {peers}"
    finally:
        server.stop(0)
