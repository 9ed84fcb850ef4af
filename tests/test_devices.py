"""The agents' device evidence: what a pair of driver readings says about a GPU, and that a machine
without NVIDIA's driver (this one, CI) says why nothing is watched instead of failing."""
import logging

from mindspeed_ha.launcher.devices import CORRECTED_STORM, DeviceHealth, Reading, judge, visible_devices


def test_a_healthy_device_and_a_few_corrected_errors_say_nothing():
    assert judge(Reading(), Reading()) is None
    assert judge(Reading(corrected=5), Reading(corrected=5 + CORRECTED_STORM - 1)) is None


def test_each_sign_of_a_failing_device_is_named():
    assert judge(Reading(), Reading(xids=(48, 63))) == "XID 48, 63"
    assert judge(Reading(uncorrected=1), Reading(uncorrected=3)) == "uncorrectable ECC errors +2"
    assert judge(Reading(), Reading(pending="row remapping")) == "row remapping pending (needs a reset)"
    assert judge(Reading(corrected=10), Reading(corrected=10 + CORRECTED_STORM)) == \
        f"corrected ECC errors +{CORRECTED_STORM} within one check"


def test_visible_devices_are_read_as_the_workers_see_them():
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "3, 1"}) == ["3", "1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-8a1c,GPU-77"}) == ["GPU-8a1c", "GPU-77"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_no_driver_means_off_and_says_why(caplog):
    caplog.set_level(logging.INFO, logger="mindspeed_ha")
    assert DeviceHealth.open(4, 30.0, 0.0) is None
    said = [r.getMessage() for r in caplog.records if "device health" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("device health: off (")
