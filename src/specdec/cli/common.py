"""What several command groups share: the help format, the draft model's flags, every
registered drafter's options, the method a command line asks for, the prompt."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..drafters import DRAFTERS, uses_draft_model
from ..drafters.base import draft_model_method, needs_draft_model


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where there is none to show (unset options say what happens
    in their own help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_draft_bits(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-bits",
        type=int,
        default=None,
        metavar="BITS",
        help="the draft model's packing (q4k mode): 4 = every layer in Q4_K blocks, 3 or 2 = its layers "
        "in 3- or 2-bit codes (cheaper, less accepted), 0 = its file's own (default: the one measured "
        "best for a known draft, else its file's)",
    )


def draft_bits(ns: argparse.Namespace) -> int | None | str:
    """--draft-bits as `api.load_draft` takes it."""
    given = getattr(ns, "draft_bits", None)
    return "default" if given is None else (given or None)


def add_auto_draft(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-auto-draft",
        dest="auto_draft",
        action="store_false",
        help="with --drafter auto and no --draft: do not draft with the draft model registered for the "
        "target (auto takes it when it is installed)",
    )


def auto_draft(ns: argparse.Namespace, method: str | None) -> None:
    """`--drafter auto` without --draft takes the draft registered for the target when it is
    installed (a user who asks for auto expects the best the machine has), and says so on
    stderr; --no-auto-draft keeps auto to the model-free drafters."""
    from .. import registry, store

    if method != "auto" or ns.draft or not getattr(ns, "auto_draft", True):
        return
    draft = registry.DRAFT_OF.get(str(ns.target))
    if draft is None or not store.is_installed(draft):
        return
    ns.draft = draft
    print(
        f"specdec: auto drafts with {draft} too, the installed draft of {ns.target} (--no-auto-draft: without it)",
        file=sys.stderr,
    )


def load_draft_model(ns: argparse.Namespace):  # noqa: ANN201 - LoadedModel
    from ..api import load_draft

    return load_draft(ns.draft, dtype=ns.dtype, device=ns.device, bits=draft_bits(ns)) if ns.draft else None


def _drafter_flags() -> dict[str, list[tuple[Any, Any, Any]]]:
    """Each command-line flag of the registered drafters' options -> (spec, option, default) of
    every drafter that declares it (EAGLE-3, Medusa and Hydra share --head and the tree flags)."""
    flags: dict[str, list[tuple[Any, Any, Any]]] = {}
    for spec in DRAFTERS.values():
        for opt, default in zip(spec.options, spec.defaults().values(), strict=True):
            flags.setdefault(opt.cli_flag, []).append((spec, opt, default))
    return flags


def add_drafter_options(p: argparse.ArgumentParser) -> None:
    """Every registered drafter's options, as declared once in the registry; a flag several
    drafters declare is one argument, given to whichever of them runs."""
    for flag, users in _drafter_flags().items():
        spec, opt, default = users[0]
        helps = (
            [
                f"{s.name}: {o.help}" + ("" if d is None or isinstance(d, bool) else f" (default: {d})")
                for s, o, d in users
            ]
            if len(users) > 1
            else [opt.help if default is None or isinstance(default, bool) else f"{opt.help} (default: {default})"]
        )
        if isinstance(default, bool):  # a switch: given -> True, absent -> the drafter's default
            p.add_argument(
                flag,
                dest=f"drafter-option:{flag}",
                action="store_const",
                const=True,
                default=None,
                help="; ".join(helps),
            )
            continue
        kind = opt.type or (type(default) if default is not None else int)
        p.add_argument(
            flag,
            dest=f"drafter-option:{flag}",
            type=kind,
            default=None,
            metavar=opt.name.upper(),
            help="; ".join(helps),
        )


def drafter_options(ns: argparse.Namespace, method: str | None, strict: bool = True) -> dict[str, Any]:
    """The options given for `method`; with `strict`, an option of another drafter is an error."""
    out = {}
    for flag, users in _drafter_flags().items():
        value = getattr(ns, f"drafter-option:{flag}", None)
        if value is None:
            continue
        mine = [opt for spec, opt, _ in users if spec.name == method]
        if not mine:
            if not strict:
                continue
            names = " / ".join(spec.name for spec, _, _ in users)
            raise ValueError(f"{flag} is an option of the {names} drafter; add --drafter {users[0][0].name} or drop it")
        out[mine[0].name] = value
    return out


def method_of(ns: argparse.Namespace, draft_for_others: bool = False) -> str | None:
    """The drafter --drafter/--draft ask for (None: plain decoding), checked: draft-model needs
    --draft, and (unless a server's requests may pick the draft model) --draft needs a drafter
    that uses it."""
    method = ns.drafter or (draft_model_method() if ns.draft else None)
    if needs_draft_model(method) and not ns.draft:
        raise ValueError(f"--drafter {method} needs --draft MODEL")
    if not draft_for_others and method is not None and not uses_draft_model(method) and ns.draft:
        raise ValueError(
            f"--draft is only used by the draft-model and auto drafters; drop it or drop --drafter {method}"
        )
    return method


def read_prompt(ns: argparse.Namespace) -> str:
    if ns.prompt is not None:
        return ns.prompt
    if str(ns.prompt_file) == "-":
        return sys.stdin.read()
    return read_text(ns.prompt_file, "prompt")


def read_text(path: Any, what: str) -> str:
    """A UTF-8 file's text; errors in one line naming `what` the file was for."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"the {what} file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
