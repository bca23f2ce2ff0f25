

@pytest.mark.slow
def test_two_torchrun_nodes_generate_like_one_rank(gqa_6x2: str) -> None:
    """Two torchrun launches (two "nodes" of one process each, one rendezvous on 127.0.0.1) run one request end
    to end: rank 0 prints the text of a single-rank engine, rank 1 exits cleanly when rank 0 stops."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--model", gqa_6x2, "--dtype", "float32", "--kv-cache-memory", "2MiB", "--max-model-len", "256",
             "--max-tokens", "6", "--temperature", "0", "--cpu-threads-per-rank", "1"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    procs = [subprocess.Popen([*torchrun, "--node-rank", str(r), "-m", "kv8", "generate", "hello world", *flags,
                               "--tensor-parallel-size", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    single = subprocess.run([sys.executable, "-m", "kv8", "generate", "hello world", *flags], capture_output=True,
                            text=True, env=env, timeout=300)
    assert single.stdout.strip() and single.stdout.strip().splitlines()[-1] in outs[0]
