"""Peak RSS (VmHWM, Linux) of `mlx-dflash serve` before and after clients post
200 MiB bodies (declared with Content-Length, then chunked), and when the 413 came.
usage: python bench/server_body_limit.py SRC_DIR SETTINGS_HOME MODEL PORT"""
import os, signal, socket, subprocess, sys, time
import httpx
src, home, model, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
env = {**os.environ, "MLX_DFLASH_HOME": home, "HF_HUB_OFFLINE": "1"}
p = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--model", model],
                     cwd=src, env=env, stderr=subprocess.DEVNULL)
for _ in range(600):
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(0.2)
time.sleep(3)
def hwm(): return int([l for l in open(f"/proc/{p.pid}/status") if l.startswith("VmHWM")][0].split()[1]) // 1024
def post(n, chunked):
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    hdr = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {n}"
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{hdr}\r\n\r\n".encode())
    piece = b" " * (1 << 20); t0 = time.perf_counter(); sent = 0
    try:
        while sent < n:
            s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n" if chunked else piece); sent += len(piece)
        if chunked: s.sendall(b"0\r\n\r\n")
        status = s.recv(64).split()[1].decode()
    except OSError as e:
        status = f"closed after {sent >> 20} MiB ({type(e).__name__})"
        try: status += " " + s.recv(64).split()[1].decode()
        except Exception: pass
    s.close()
    return status, time.perf_counter() - t0
base = hwm()
for chunked in (False, True):
    st, dt = post(200 << 20, chunked)
    print(f"{'chunked' if chunked else 'Content-Length'} 200 MiB body: answer {st} after {dt:.2f} s; peak RSS {base} -> {hwm()} MiB")
p.send_signal(signal.SIGINT); p.wait(30)
