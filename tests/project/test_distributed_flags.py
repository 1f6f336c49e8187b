"""Multi-host init stays off without --coordinator_address and validates its flags."""
import pytest
from absl import flags

from talaria_jax.sharding import distributed


def test_off_by_default_and_validates():
    fv = flags.FLAGS
    fv(["prog"])
    assert distributed.maybe_initialize() is False
    fv(["prog", "--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=5"])
    try:
        with pytest.raises(ValueError, match=r"--process_id \(5\) must be in \[0, --num_processes=2\)"):
            distributed.maybe_initialize()
    finally:
        fv.unparse_flags()
