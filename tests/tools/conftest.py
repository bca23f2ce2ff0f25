"""Fixtures of the tools' tests."""

from __future__ import annotations

import pytest

from tests.helpers.calibration import write_calibration_text


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The calibration text (:func:`tests.helpers.calibration.write_calibration_text`) in a temporary directory."""
    return write_calibration_text(tmp_path_factory.mktemp("data") / "calib.txt")
