"""components.graph.runtime.nodelay_listener: Nagle off on a listener of this process that a
server opened without it (as Dynamo's OpenAI service does), for every connection it accepts."""

import socket

from components.graph.runtime import nodelay_listener


def test_connections_accepted_after_it_have_nagle_off():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        assert nodelay_listener(port)
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def test_a_port_nothing_here_listens_on_is_reported():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            with accepted:
                # connected sockets on the port (either end) are not listeners
                assert not nodelay_listener(client.getsockname()[1])
        listener.close()
        assert not nodelay_listener(port)
