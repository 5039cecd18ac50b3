"""A raw ZMTP 3.0 peer (NULL security) on a plain TCP socket: what an
unauthenticated attacker can send to a ZeroMQ endpoint, frame by frame, without
pyzmq buffering the frames on its own side first."""

from __future__ import annotations

import socket
import struct

_GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
             + b"\x00" + b"\x00" * 31)
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


class RawPeer:
    """Connects to ``tcp://HOST:PORT`` as a ``socket_type`` (b"PUSH", b"DEALER")."""

    def __init__(self, endpoint: str, socket_type: bytes, timeout: float = 10.0) -> None:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.sendall(_GREETING)
        greeting = b""
        while len(greeting) < len(_GREETING):
            part = self.sock.recv(len(_GREETING) - len(greeting))
            if not part:
                raise ConnectionError("the endpoint closed during the ZMTP greeting")
            greeting += part
        prop = b"\x0bSocket-Type" + struct.pack("!I", len(socket_type)) + socket_type
        body = b"\x05READY" + prop
        self.sock.sendall(bytes([_COMMAND, len(body)]) + body)

    def send_frame_header(self, size: int, more: bool = False) -> None:
        """Announce a frame of ``size`` bytes; its body follows with ``send_raw``."""
        self.sock.sendall(bytes([_LONG | (_MORE if more else 0)]) + struct.pack("!Q", size))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_message(self, *frames: bytes) -> None:
        for index, frame in enumerate(frames):
            self.send_frame_header(len(frame), more=index < len(frames) - 1)
            self.send_raw(frame)

    def stream_frame(self, size: int, chunk: int = 1 << 20) -> bool:
        """Send one frame of ``size`` junk bytes; False if the endpoint dropped us
        before it was all sent."""
        block = b"\x00" * chunk
        try:
            self.send_frame_header(size)
            sent = 0
            while sent < size:
                self.send_raw(block[:size - sent])
                sent += min(chunk, size - sent)
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def close(self) -> None:
        self.sock.close()
