"""Progress bars (moerun.progress): on a terminal, loading a model shows one on stderr, and so does the first
hardware probe; into a pipe, or with --no-progress, nothing extra is written."""

import fcntl
import os
import struct
import subprocess
import sys
import termios
import threading

RUN = [sys.executable, "-m", "moerun", "run", "-p", "def f(", "-n", "2", "--temp", "0"]


def _under_pty(args, env=None) -> tuple[int, str, str]:
    """(exit status, stdout, what the command wrote to its terminal stderr)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})
    os.close(slave)
    chunks: list[bytes] = []

    def drain():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the other end closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    out, _ = proc.communicate(timeout=300)
    reader.join(timeout=30)
    os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def test_loading_shows_a_bar_on_a_terminal_only():
    rc, out, tty = _under_pty(RUN)
    assert rc == 0 and out.startswith("def f(")
    assert "loading" in tty and "%|" in tty  # tqdm's bar: "loading:  42%|####  | 3.8M/9.13M"
    rc, out_quiet, tty_quiet = _under_pty(RUN + ["--no-progress"])
    assert rc == 0 and "loading" not in tty_quiet and "%|" not in tty_quiet and out_quiet == out
    piped = subprocess.run(RUN, capture_output=True, text=True, timeout=300, check=False)
    assert piped.returncode == 0 and "loading" not in piped.stderr and "%|" not in piped.stderr
    assert piped.stdout == out


def test_the_first_probe_shows_a_bar_on_a_terminal(tmp_path):
    env = {"MOERUN_CACHE": str(tmp_path / "cache")}
    rc, _out, tty = _under_pty([sys.executable, "-m", "moerun", "estimate", "default", "-t", "1"], env)
    assert rc == 0 and "probing" in tty and "probe" in tty
    piped = subprocess.run([sys.executable, "-m", "moerun", "estimate", "default", "-t", "1"], capture_output=True,
                           text=True, timeout=300, env={**os.environ, **env}, check=False)
    assert piped.returncode == 0 and "probing" not in piped.stderr
