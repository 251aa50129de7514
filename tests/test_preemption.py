"""SIGTERM/SIGINT become a flag; a second Ctrl-C quits at once; the previous handlers come back afterwards."""

import os
import signal

import pytest

from s4accel.training.preemption import StopSignals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sets_the_flag_instead_of_killing(sig):
    before = signal.getsignal(sig)
    with StopSignals() as signals:
        assert signals.received is None
        os.kill(os.getpid(), sig)
        assert signals.received == sig.name
    assert signal.getsignal(sig) is before


def test_a_second_ctrl_c_raises_keyboard_interrupt():
    with StopSignals():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
