"""A private nginx, the reference P1 measures against: the same file by sendfile."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

_NGINX_CONF = """
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 64; }}
http {{
    sendfile on;
    access_log off;
    client_body_temp_path {d}/tmp;
    proxy_temp_path {d}/tmp;
    fastcgi_temp_path {d}/tmp;
    uwsgi_temp_path {d}/tmp;
    scgi_temp_path {d}/tmp;
    server {{
        listen 127.0.0.1:{port};
        root {d}/root;
    }}
}}
"""


def nginx_exe() -> str | None:
    """nginx on PATH, or where Debian installs it (/usr/sbin, off a user's PATH); None without one."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


NO_NGINX = "nginx not found (on PATH or in /usr/sbin; scripts/setup.sh installs Debian's nginx-light)"


class Nginx:
    """A private nginx serving `root` on a free port, in the foreground, every file of it in `d`."""

    def __init__(self, d: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(f"{d}/nginx.conf", "w") as f:
            f.write(_NGINX_CONF.format(d=d, port=port))
        exe = nginx_exe()
        assert exe is not None
        self.proc = subprocess.Popen([exe, "-p", d, "-e", f"{d}/error.log", "-c", f"{d}/nginx.conf"],
                                     stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    error = Path(d, "error.log").read_text()[-500:]
                    raise RuntimeError(f"nginx did not start: {error}") from None
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
