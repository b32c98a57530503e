"""The local Ray a run starts holds no idle workers (each ~80 MB RSS): a run's actors start their own."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CODE = """
import time, psutil, ray
from pipeline.cluster import init_ray
from pipeline.config import Config
init_ray(Config(), 2)
time.sleep(3)          # a prestart would have begun by now: Ray starts them when the driver registers
titles = [" ".join(p.cmdline()[:1]) for p in psutil.Process().children(recursive=True)]
ray.shutdown()
print(sum(t.startswith("ray::IDLE") for t in titles), len(titles))
"""


def test_local_ray_prestarts_no_idle_workers():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    idle, procs = map(int, out.stdout.split()[-2:])
    assert procs > 0          # Ray's own processes are there (gcs, raylet, agents): the walk saw the tree
    assert idle == 0
