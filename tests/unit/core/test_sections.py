"""A settings dataclass read from its config section: by field type, defaults kept."""

from __future__ import annotations

from dataclasses import dataclass

from batchyard.core.sections import section_settings


@dataclass(frozen=True, slots=True)
class _Knobs:
    poll_s: float = 0.5
    width: int = 4
    name: str = "a"
    networks: tuple[str, ...] = ()


def test_each_key_takes_its_fields_type_and_unknown_keys_are_left() -> None:
    got = section_settings(_Knobs, {"poll_s": 2, "width": "8", "other": 1})
    assert got == _Knobs(poll_s=2.0, width=8)
    assert isinstance(got.poll_s, float) and isinstance(got.width, int)


def test_a_field_of_another_type_takes_its_parser_and_no_section_is_the_defaults() -> None:
    got = section_settings(_Knobs, {"networks": ["x", "y"]}, networks=tuple)
    assert got.networks == ("x", "y")
    assert section_settings(_Knobs, None) == _Knobs()
