"""`s4accel train` keeps freed activations in the process (glibc): a step's large temporaries are not page-faulted
in again on every step."""

import os
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc mallopt")

PROBE = """
import resource, sys, torch
from s4accel.allocator import keep_freed_memory
from s4accel.models.configuration_s4 import S4Config
from s4accel.models.modeling_s4 import S4Layer
torch.set_num_threads(1)
applied = keep_freed_memory() if sys.argv[1] == "tuned" else None
layer = S4Layer(S4Config(d_model=64, d_state=16))
layer.kernel.reset_parameters()
torch.nn.init.normal_(layer.D)
x = torch.randn(4, 1024, 64, requires_grad=True)
def step():  # a training step's shape: the same large activations allocated and freed every time
    layer(x)[0].sum().backward()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
before = faults()
for _ in range(10):
    step()
print(applied, faults() - before)
"""


def probe(mode, **env):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **env})
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    # Medians of three: the kernel's own page handling varies the counts between runs (within a full suite, once
    # 10k plain against 2.6k tuned), while the tuning's effect is several-fold.
    plain = statistics.median(probe("plain")[1] for _ in range(3))
    runs = [probe("tuned") for _ in range(3)]
    tuned = statistics.median(faults for _, faults in runs)
    assert all(applied == "True" for applied, _ in runs)
    assert plain > 10 * 1000  # thousands of pages faulted in again on every step (24k measured)
    assert tuned < plain / 5  # 1.5k measured


def test_the_user_can_turn_it_off_or_choose_their_own_settings():
    assert probe("tuned", S4ACCEL_KEEP_MALLOC="1")[0] == "False"
    assert probe("tuned", MALLOC_TRIM_THRESHOLD_="1000000")[0] == "False"
