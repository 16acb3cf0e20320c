"""What the serving tests send: a multipart form around an image, and calls made side by side.
(No tests here: test_serve and test_ray import it.)"""
from __future__ import annotations

import threading


def multipart(data: bytes, boundary: str = "formula-boundary") -> tuple[bytes, str]:
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhello\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.png\"\r\n"
            f"Content-Type: image/png\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def side_by_side(fn, args: list) -> list:
    """``fn(*a)`` for each ``a`` of ``args``, each on a thread of its own, all at once; the results in order."""
    out = [None] * len(args)
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(*args[i]))) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
