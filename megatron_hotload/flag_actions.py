"""The argparse actions behind the ``--hotload-*`` flags: how a value given on the command line is stored.

Kept apart from :mod:`megatron_hotload.args` (which maps config fields to flags) because each action exists for a
way of writing a flag that the plain argparse actions got wrong:

* a boolean written as its variable is (``--hotload-publish-on-close false``) was a bare switch and a stray word,
  which Megatron's parser refused without naming the flag and ``parse_known_args`` dropped, leaving True;
* a list written as Megatron's own list flags are (``--hotload-deployment-id dep-a dep-b``) kept ``dep-a`` alone;
* a secret written as a flag (``--hotload-api-key fw_...``) was refused as an unrecognized argument, and argparse
  printed the key in that error on every rank's stderr.

Megatron saves the parsed namespace in its checkpoints and loads it back with ``torch.load``, which refuses
classes it was not told of: every action stores builtin values only.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

from pydantic import TypeAdapter, ValidationError

from fsdp_hotload.config_text import parse_setting

PREFIX = "hotload"
#: The namespace attribute that lists, by field name, the flags given as ``null``.
NULL_FIELDS = f"{PREFIX}_null_fields"

_BOOL = TypeAdapter(bool)


def parse_boolean(text: str) -> bool:
    """A boolean flag's value, read as its ``HOTLOAD_*`` variable is (the text rule, then the config's own
    conversion: true/false, 1/0, yes/no, on/off)."""
    try:
        return _BOOL.validate_python(parse_setting(text, bool))
    except (ValueError, ValidationError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a boolean: give true or false (or leave the value out "
                                         "for true)") from None


class StoreSetting(argparse.Action):
    """Stores a flag's value; a ``null`` (None) is also listed in :data:`NULL_FIELDS`.

    None in the flag's own attribute reads as 'not given', so the list is what lets a ``null`` flag win over its
    variable (a builtin list: a marker object of ours made every checkpoint unloadable).
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        field = self.dest[len(PREFIX) + 1:]
        nulls = [f for f in getattr(namespace, NULL_FIELDS, None) or [] if f != field]  # the last flag wins
        setattr(namespace, NULL_FIELDS, [*nulls, field] if values is None else nulls)


class ListSetting(StoreSetting):
    """A list flag: one value read as its variable is (a JSON list, ``null``, or for a field that also takes a
    single string, that string), or several plain values, space-separated as Megatron's own list flags are.

    ``convert`` reads one value by the variables' rule (one plain word of a field that takes lists only is the
    list of it: ``--hotload-carry-base-tensors mtp.*``, as ``HOTLOAD_CARRY_BASE_TENSORS=mtp.*``).
    """

    def __init__(self, option_strings: Sequence[str], dest: str, *, convert: Callable[[str], Any],
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="+", **kwargs)
        self.convert = convert

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        words = list(values)
        plain = [bool(w.strip()) and w.strip()[:1] not in "[{\"" and w.strip() != "null" and "," not in w
                 for w in words]
        try:
            if len(words) == 1:
                value = self.convert(words[0])
            elif all(plain):
                value = words
            else:
                raise argparse.ArgumentTypeError(
                    "give one JSON list, or several plain values (no JSON, null, comma or empty value among them): "
                    f"{words[plain.index(False)]!r} is not one")
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        super().__call__(parser, namespace, value, option_string)


class Switch(argparse.Action):
    """A boolean flag: bare (true) or with a value read as its variable is (``--hotload-send-hints false``).
    Its ``--no-`` form is a :class:`NegatedSwitch`."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", const=True, type=parse_boolean, metavar="true|false",
                         **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


class NegatedSwitch(argparse.Action):
    """The ``--no-`` form of a boolean flag: False. A value after it is an error naming the flag, not a stray word
    that ``parse_known_args`` would drop (``--no-hotload-send-hints true`` meant False)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values is not None:
            raise argparse.ArgumentError(self, f"takes no value (got {values!r}): write it alone for false, or the "
                                               f"flag without no- and a value (true or false)")
        setattr(namespace, self.dest, False)


class RefuseSecret(argparse.Action):
    """A secret written as a flag: an error that names its variables and never shows the value.

    Why a hidden flag rather than none: argparse's 'unrecognized arguments' error quoted the value (the API key in
    every rank's log), and under ``parse_known_args`` the flag was dropped without a word. The value is not stored
    (no attribute at all: the namespace goes into Megatron's printout and checkpoints).
    """

    def __init__(self, option_strings: Sequence[str], dest: str, *, variables: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                         **kwargs)
        self.variables = variables

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"argument {option_string}: a secret is not taken as a flag, since Megatron prints its "
                     f"arguments and saves them in its checkpoints (the value is not shown here); set "
                     f"{self.variables} instead")
