"""tests/gpu/benchmark_runs.launch, the GPU tests' launcher: a launch that outlives its limit fails with what it
printed until then and the caller's extra text (the ranks' hang dumps), not with a bare TimeoutExpired."""
import sys

import pytest

from tests.gpu.benchmark_runs import launch


def test_a_launch_past_its_limit_fails_with_its_output_so_far():
    cmd = [sys.executable, "-c", "import sys, time; print('rank 0 at iteration 3', flush=True); "
                                 "print('waiting in all_to_all', file=sys.stderr, flush=True); time.sleep(60)"]
    with pytest.raises(AssertionError) as e:
        launch(cmd, timeout=3, what=lambda: "== rank0.stacks.txt")
    text = str(e.value)
    assert "no exit after 3 s" in text and "rank 0 at iteration 3" in text and "waiting in all_to_all" in text
    assert "== rank0.stacks.txt" in text


def test_a_launch_within_its_limit_returns_its_result():
    p = launch([sys.executable, "-c", "print('done')"], timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "done"
