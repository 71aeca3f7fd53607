"""GPT-2's byte <-> printable-character table used by byte-level BPE vocabularies.

Byte-level BPE vocabularies (GPT-2, GPT-NeoX, and any trained with ``ByteLevel``) store each raw byte as
one printable unicode character so tokens are readable JSON strings. Bytes that are already printable
(and not a space) stand for themselves; the remaining 68 are shifted to code points 256, 257, ...
in byte order.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def byte_to_char() -> dict[int, str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


def token_to_bytes(token: str) -> bytes | None:
    """Raw bytes of a vocabulary entry, or None if it is not written in the byte alphabet."""
    table = char_to_byte()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return None
