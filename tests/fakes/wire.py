"""Encodings the fake runtimes share: NetTrace's variable-length integers
and the UTF-16 strings of the diagnostic IPC protocol and event metadata."""


def utf16z(text):
    return text.encode("utf-16-le") + b"\0\0"


def varuint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value == 0:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)
