"""RFC 6455 without sockets: the handshake example, §5.7's frame bytes, reassembly, errors."""

import pytest

from streaming.wire import websocket as ws
from streaming.wire.errors import ProtocolError
from streaming.wire.http11 import parse_head

MASK = bytes([0x37, 0xFA, 0x21, 0x3D])  # the masking key of RFC 6455 §5.7's examples


def test_the_rfc_handshake_example():
    assert ws.accept_key("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # §1.3


def upgrade(*extra, method="GET"):
    head = (
        f"{method} /ws HTTP/1.1\r\nHost: 127.0.0.1:8765\r\nUpgrade: websocket\r\nConnection: keep-alive, Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13"
    )
    for line in extra:
        name = line.split(":")[0].lower()
        head = "\r\n".join(x for x in head.split("\r\n") if x.split(":")[0].lower() != name or x == line)
        if line not in head:
            head += "\r\n" + line
    return parse_head(head.encode())


def test_a_valid_handshake_gets_101_with_the_accept_key():
    out = ws.handshake(upgrade())
    assert out.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
    assert b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n" in out


@pytest.mark.parametrize(
    "extra,status",
    [
        (["Upgrade: h2c"], 426),
        (["Connection: close"], 400),
        (["Sec-WebSocket-Version: 8"], 426),
        (["Sec-WebSocket-Key: short"], 400),
        (["Sec-WebSocket-Key: !!!notbase64!!!!!!!!!!="], 400),
        (["Origin: http://evil.example"], 403),
        (["Origin: http://127.0.0.1:9999"], 403),
        (["Origin: null"], 403),
    ],
)
def test_bad_handshakes(extra, status):
    with pytest.raises(ProtocolError) as e:
        ws.handshake(upgrade(*extra))
    assert e.value.status == status
    if status == 426 and "Version" in extra[0]:
        assert ("Sec-WebSocket-Version", "13") in e.value.headers


def test_origin_our_own_or_listed():
    ws.handshake(upgrade("Origin: http://127.0.0.1:8765"))
    ws.handshake(upgrade("Origin: https://app.example"), allowed_origins=["https://app.example"])
    ws.handshake(upgrade("Origin: https://any.example"), allowed_origins=["*"])
    assert ws.origin_allowed("http://localhost", "localhost", [])
    assert ws.origin_allowed("https://h.example", "h.example:443", [])


def test_post_is_405():
    with pytest.raises(ProtocolError) as e:
        ws.handshake(upgrade(method="POST"))
    assert e.value.status == 405


# §5.7 examples, exact bytes
HELLO_UNMASKED = bytes([0x81, 0x05, 0x48, 0x65, 0x6C, 0x6C, 0x6F])
HELLO_MASKED = bytes([0x81, 0x85, 0x37, 0xFA, 0x21, 0x3D, 0x7F, 0x9F, 0x4D, 0x51, 0x58])
HEL_LO = bytes([0x01, 0x03, 0x48, 0x65, 0x6C]) + bytes([0x80, 0x02, 0x6C, 0x6F])
PING_HELLO = bytes([0x89, 0x05, 0x48, 0x65, 0x6C, 0x6C, 0x6F])
PONG_HELLO_MASKED = bytes([0x8A, 0x85, 0x37, 0xFA, 0x21, 0x3D, 0x7F, 0x9F, 0x4D, 0x51, 0x58])


def test_serialize_the_rfc_examples():
    assert ws.serialize(ws.Frame(ws.TEXT, b"Hello")) == HELLO_UNMASKED
    assert ws.serialize(ws.Frame(ws.TEXT, b"Hello"), MASK) == HELLO_MASKED
    assert ws.serialize(ws.Frame(ws.TEXT, b"Hel", fin=False)) + ws.serialize(ws.Frame(ws.CONT, b"lo")) == HEL_LO
    assert ws.serialize(ws.Frame(ws.PING, b"Hello")) == PING_HELLO
    assert ws.serialize(ws.Frame(ws.PONG, b"Hello"), MASK) == PONG_HELLO_MASKED
    assert ws.serialize(ws.Frame(ws.BINARY, bytes(256)))[:4] == bytes([0x82, 0x7E, 0x01, 0x00])
    assert ws.serialize(ws.Frame(ws.BINARY, bytes(65536)))[:10] == bytes([0x82, 0x7F, 0, 0, 0, 0, 0, 1, 0, 0])
    assert ws.serialize(ws.Frame(ws.TEXT, b"x" * 125))[:2] == bytes([0x81, 125])
    assert ws.serialize(ws.Frame(ws.TEXT, b"x" * 126))[:4] == bytes([0x81, 126, 0, 126])


def parse_all(data, step=None, mask_required=False):
    p = ws.Parser(mask_required=mask_required)
    out = []
    chunks = [data] if step is None else [data[i : i + step] for i in range(0, len(data), step)]
    for chunk in chunks:
        p.feed(chunk)
        while (item := p.next()) is not None:
            out.append(item)
    return out, p


STEPS = [None, 1, 2, 5]


@pytest.mark.parametrize("step", STEPS)
def test_parse_the_rfc_examples(step):
    out, _ = parse_all(HELLO_MASKED, step, mask_required=True)
    assert out == [ws.Message(ws.TEXT, b"Hello")]
    out, _ = parse_all(HEL_LO + PING_HELLO, step)
    assert out == [ws.Message(ws.TEXT, b"Hello"), ws.Frame(ws.PING, b"Hello")]
    out, _ = parse_all(PONG_HELLO_MASKED, step, mask_required=True)
    assert out == [ws.Frame(ws.PONG, b"Hello")]


@pytest.mark.parametrize("step", STEPS)
def test_a_ping_between_fragments_is_returned_first(step):
    data = ws.serialize(ws.Frame(ws.TEXT, "🦜".encode()[:2], fin=False), MASK)
    data += ws.serialize(ws.Frame(ws.PING, b"p"), MASK)
    data += ws.serialize(ws.Frame(ws.CONT, "🦜".encode()[2:]), MASK)
    out, _ = parse_all(data, step, mask_required=True)
    assert out == [ws.Frame(ws.PING, b"p"), ws.Message(ws.TEXT, "🦜".encode())]


@pytest.mark.parametrize("n", [0, 125, 126, 65535, 65536, 70000])
def test_7_16_and_64_bit_lengths_round_trip(n):
    data = bytes(range(256)) * (n // 256) + bytes(n % 256)
    out, _ = parse_all(ws.serialize(ws.Frame(ws.BINARY, data), MASK), mask_required=True)
    assert out == [ws.Message(ws.BINARY, data)]


def test_trailing_bytes_stay_in_the_buffer():
    p = ws.Parser(mask_required=True)
    p.feed(HELLO_MASKED + HELLO_MASKED[:3])
    assert p.next() == ws.Message(ws.TEXT, b"Hello")
    assert p.next() is None and bytes(p.buffer) == HELLO_MASKED[:3]


def frame_bytes(first, second, rest=b""):
    return bytes([first, second]) + rest


BAD_FRAMES = [
    (HELLO_UNMASKED, 1002),  # a client frame must be masked
    (frame_bytes(0xC1, 0x80, MASK), 1002),  # RSV1 without an extension
    (frame_bytes(0x83, 0x80, MASK), 1002),  # opcode 3 is reserved
    (frame_bytes(0x8B, 0x80, MASK), 1002),  # opcode 0xB is reserved
    (frame_bytes(0x89, 0xFE, b"\x00\x7e" + MASK + bytes(126)), 1002),  # ping over 125 bytes
    (frame_bytes(0x09, 0x80, MASK), 1002),  # fragmented ping
    (frame_bytes(0x80, 0x80, MASK), 1002),  # continuation with nothing to continue
    (ws.serialize(ws.Frame(ws.TEXT, b"a", fin=False), MASK) * 2, 1002),  # new message inside a fragmented one
    (ws.serialize(ws.Frame(ws.TEXT, b"\xff"), MASK), 1007),  # invalid UTF-8
    (ws.serialize(ws.Frame(ws.TEXT, b"\xf0\x9f", fin=False), MASK) + ws.serialize(ws.Frame(ws.CONT, b"a"), MASK), 1007),
    (frame_bytes(0x81, 0xFF, (2 * 1024 * 1024).to_bytes(8, "big")), 1009),  # 2 MiB announced: refused at once
    (frame_bytes(0x81, 0xFF, (1 << 63).to_bytes(8, "big")), 1002),  # top bit of a 64-bit length
    (frame_bytes(0x88, 0x81, MASK + b"\x00"), 1002),  # close with a 1-byte payload
    (ws.close_frame(999, mask=MASK), 1002),  # invalid close code
    (ws.close_frame(1005, mask=MASK), 1002),  # 1005 must never be sent
    (ws.serialize(ws.Frame(ws.CLOSE, b"\x03\xe8\xff"), MASK), 1007),  # close reason not UTF-8
]


@pytest.mark.parametrize("data,code", BAD_FRAMES)
def test_protocol_violations_carry_their_close_code(data, code):
    for step in (None, 1):
        with pytest.raises(ProtocolError) as e:
            parse_all(data, step, mask_required=True)
        assert e.value.close_code == code


def test_fragmented_message_over_the_limit_is_1009():
    p = ws.Parser(mask_required=True, max_message=10)
    p.feed(ws.serialize(ws.Frame(ws.TEXT, b"123456", fin=False), MASK))
    assert p.next() is None
    p.feed(ws.serialize(ws.Frame(ws.CONT, b"789012"), MASK))
    with pytest.raises(ProtocolError) as e:
        p.next()
    assert e.value.close_code == 1009


def test_close_payloads():
    assert ws.parse_close(b"") == (1005, "")
    assert ws.parse_close(ws.close_payload(1000, "bye")) == (1000, "bye")
    assert ws.parse_close(ws.close_payload(4000)) == (4000, "")
    assert len(ws.close_payload(1000, "é" * 200)) <= 125


def test_a_message_may_come_in_1024_fragments_not_more():
    def fragments(n):
        out = ws.serialize(ws.Frame(ws.TEXT, b"{", fin=False), MASK)
        out += ws.serialize(ws.Frame(ws.CONT, b" ", fin=False), MASK) * (n - 2)
        return out + ws.serialize(ws.Frame(ws.CONT, b"}"), MASK)

    p = ws.Parser()
    p.feed(fragments(ws.MAX_FRAGMENTS))
    message = p.next()
    assert message.data == b"{" + b" " * (ws.MAX_FRAGMENTS - 2) + b"}"
    p = ws.Parser()
    p.feed(fragments(ws.MAX_FRAGMENTS + 1))
    with pytest.raises(ProtocolError) as e:
        p.next()
    assert e.value.close_code == 1009
