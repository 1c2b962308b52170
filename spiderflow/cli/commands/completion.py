"""``spiderflow completion bash|zsh|fish``: print a shell completion script for the ``spiderflow`` command.

The script is generated from the argparse tree (:func:`spiderflow.cli.main.build_parser`), so it always
matches the installed commands: subcommands (with their help in zsh and fish), options per command, the
choices of options and positionals that have them (``--kind geo|hub|mesh``, ``serve planner|scheduler|
topology``), the model presets (``--model``), placement policies (``--policy``), topology presets (and
files: ``--topology``), file names for file arguments (``--png FILE``, ``topology validate FILE``) and job
ids for ``JOB`` arguments (``status``, ``watch``, ``logs``, ...). Install::

    source <(spiderflow completion bash)        # ~/.bashrc
    source <(spiderflow completion zsh)         # ~/.zshrc, after compinit
    spiderflow completion fish > ~/.config/fish/completions/spiderflow.fish

The script is plain bash / zsh / fish; only job ids are asked of the scheduler at completion time
(``spiderflow completion --job-ids``, at most 5 s; nothing when no mesh answers).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Node", "command_tree", "register", "render"]

SHELLS = ("bash", "zsh", "fish")
JOBS = "__jobs__"
"""The positional-value marker of a job id (the scripts ask ``spiderflow completion --job-ids``)."""
_FILE_HINTS = ("FILE", "DIR", "PATH")


@dataclass(slots=True)
class Node:
    """One (sub)command: its subcommands (name → help, node), options and what their values are."""

    subs: dict[str, tuple[str, Node]] = field(default_factory=dict)
    options: list[str] = field(default_factory=list)
    valued: set[str] = field(default_factory=set)  # options that take a value
    choices: dict[str, list[str]] = field(default_factory=dict)  # option → its choices
    files: set[str] = field(default_factory=set)  # options whose value is a file name
    positional_choices: list[str] = field(default_factory=list)
    positional_files: bool = False


def _is_file(action: argparse.Action) -> bool:
    metavar = str(action.metavar or "").upper()
    return action.type is Path or any(h in metavar for h in _FILE_HINTS)


def _known_values() -> dict[str, list[str]]:
    """Values of options that name a known thing: model presets, placement policies, topology presets."""
    from spiderflow.core.catalog import MODEL_PRESETS
    from spiderflow.core.placement import load_builtin_policies
    from spiderflow.core.placement.base import REGISTRY

    load_builtin_policies()
    presets = sorted(p.stem for p in Path(__file__).resolve().parents[2].joinpath("presets").glob("*.json"))
    return {"--model": sorted(MODEL_PRESETS), "--policy": sorted(REGISTRY), "--topology": presets}


def command_tree(parser: argparse.ArgumentParser, values: dict[str, list[str]] | None = None) -> Node:
    """The completion-relevant part of ``parser`` and its subparsers (``values``: option → known values)."""
    values = _known_values() if values is None else values
    node = Node()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                node.subs[name] = (helps.get(name, ""), command_tree(sub, values))
            continue
        if not action.option_strings:
            if str(action.metavar or "") == "JOB" or action.dest == "job_id":
                node.positional_choices = [JOBS]
            elif action.choices:
                node.positional_choices += [str(c) for c in action.choices]
            elif _is_file(action):
                node.positional_files = True
            continue
        node.options += action.option_strings
        if action.nargs != 0:
            for opt in action.option_strings:
                node.valued.add(opt)
                if action.choices:
                    node.choices[opt] = [str(c) for c in action.choices]
                elif opt in values:
                    node.choices[opt] = list(values[opt])
                    if opt == "--topology":
                        node.files.add(opt)
                elif _is_file(action):
                    node.files.add(opt)
    return node


def _walk(node: Node, path: str = "") -> list[tuple[str, Node]]:
    out = [(path, node)]
    for name, (_help, sub) in node.subs.items():
        out += _walk(sub, f"{path} {name}".strip())
    return out


def _case(lines: list[str], key: str, value: str) -> None:
    lines.append(f'        "{key}") echo "{value}" ;;')


def _tables(root: Node, *, zsh: bool) -> str:
    """Shell functions answering, for a command path, its subcommands, options, valued options, the
    choices of an option and whether an option takes a file (shared by both scripts)."""
    nodes = _walk(root)
    subs: list[str] = []
    opts: list[str] = []
    valued: list[str] = []
    choices: list[str] = []
    files: list[str] = []
    pos: list[str] = []
    for path, node in nodes:
        if node.subs:
            _case(subs, path, " ".join(node.subs))
        _case(opts, path, " ".join(node.options))
        if node.valued:
            _case(valued, path, " ".join(sorted(node.valued)))
        for opt, values in node.choices.items():
            _case(choices, f"{path}|{opt}", " ".join(values))
        for opt in sorted(node.files):
            _case(files, f"{path}|{opt}", "1")
        if node.positional_choices:
            _case(pos, path, " ".join(node.positional_choices))
        elif node.positional_files and not node.subs:
            _case(pos, path, "__files__")

    def fn(name: str, arg: str, body: list[str]) -> str:
        return "\n".join([f"_spiderflow_{name}() {{", f'    case "{arg}" in', *body, "    esac", "}"])

    parts = [
        fn("subs", "$1", subs), fn("opts", "$1", opts), fn("valued", "$1", valued),
        fn("choices", "$1|$2", choices), fn("files", "$1|$2", files), fn("positional", "$1", pos),
    ]
    if zsh:
        desc: list[str] = []
        for path, node in nodes:
            if node.subs:
                items = " ".join(_zsh_quote(f"{name}:{h}") for name, (h, _n) in node.subs.items())
                desc.append(f'        "{path}") reply=({items}) ;;')
        parts.append("\n".join(["_spiderflow_described() {", "    reply=()", '    case "$1" in', *desc, "    esac",
                                "}"]))
    return "\n\n".join(parts)


def _zsh_quote(text: str) -> str:
    return "'" + " ".join(text.split()).replace("'", "'\\''") + "'"


# The command path is the subcommands typed so far; option values (``--kind geo``) are skipped.
_BASH = r"""# bash completion for spiderflow (generated by `spiderflow completion bash`).
# Install: source <(spiderflow completion bash)

{tables}

_spiderflow_path() {{
    local w i skip=0 subs
    _spiderflow_cmdpath=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${{COMP_WORDS[i]}}"
        if ((skip)); then skip=0; continue; fi
        if [[ $w == -* ]]; then
            [[ $w != *=* && " $(_spiderflow_valued "$_spiderflow_cmdpath") " == *" $w "* ]] && skip=1
            continue
        fi
        subs=" $(_spiderflow_subs "$_spiderflow_cmdpath") "
        [[ $subs == *" $w "* ]] && _spiderflow_cmdpath="${{_spiderflow_cmdpath:+$_spiderflow_cmdpath }}$w"
    done
}}

_spiderflow() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}" words pos
    _spiderflow_path
    local p="$_spiderflow_cmdpath"
    COMPREPLY=()
    if [[ $prev == -* && " $(_spiderflow_valued "$p") " == *" $prev "* ]]; then
        words="$(_spiderflow_choices "$p" "$prev")"
        [[ -n $words ]] && COMPREPLY=($(compgen -W "$words" -- "$cur"))
        if [[ -n "$(_spiderflow_files "$p" "$prev")" ]]; then
            compopt -o filenames 2>/dev/null
            COMPREPLY+=($(compgen -f -- "$cur"))
        fi
        return 0
    fi
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$(_spiderflow_opts "$p")" -- "$cur"))
        return 0
    fi
    words="$(_spiderflow_subs "$p")"
    pos="$(_spiderflow_positional "$p")"
    if [[ -n $words ]]; then
        COMPREPLY=($(compgen -W "$words" -- "$cur"))
    elif [[ $pos == __files__ ]]; then
        compopt -o filenames 2>/dev/null
        COMPREPLY=($(compgen -f -- "$cur"))
    elif [[ $pos == __jobs__ ]]; then
        COMPREPLY=($(compgen -W "$(spiderflow completion --job-ids 2>/dev/null)" -- "$cur"))
    elif [[ -n $pos ]]; then
        COMPREPLY=($(compgen -W "$pos" -- "$cur"))
    fi
    return 0
}}

complete -F _spiderflow spiderflow
"""

# zsh: ``words`` is 1-based and ``CURRENT`` indexes the word being completed. ``path`` is special in
# zsh (tied to $PATH), hence ``cmdpath``.
_ZSH = r"""#compdef spiderflow
# zsh completion for spiderflow (generated by `spiderflow completion zsh`).
# Install: source <(spiderflow completion zsh)   (after compinit)

{tables}

_spiderflow() {{
    local cmdpath="" w i skip=0 prev cur words_ pos
    local -a reply
    for ((i = 2; i < CURRENT; i++)); do
        w="${{words[i]}}"
        if ((skip)); then skip=0; continue; fi
        if [[ $w == -* ]]; then
            [[ $w != *=* && " $(_spiderflow_valued "$cmdpath") " == *" $w "* ]] && skip=1
            continue
        fi
        [[ " $(_spiderflow_subs "$cmdpath") " == *" $w "* ]] && cmdpath="${{cmdpath:+$cmdpath }}$w"
    done
    prev="${{words[CURRENT-1]}}"
    cur="${{words[CURRENT]}}"
    if [[ $prev == -* && " $(_spiderflow_valued "$cmdpath") " == *" $prev "* ]]; then
        words_="$(_spiderflow_choices "$cmdpath" "$prev")"
        [[ -n $words_ ]] && compadd -- ${{=words_}}
        if [[ -n "$(_spiderflow_files "$cmdpath" "$prev")" ]]; then
            _files
        elif [[ -z $words_ ]]; then
            _message "${{prev#--}}"
        fi
        return
    fi
    if [[ $cur == -* ]]; then
        compadd -- ${{=$(_spiderflow_opts "$cmdpath")}}
        return
    fi
    _spiderflow_described "$cmdpath"
    pos="$(_spiderflow_positional "$cmdpath")"
    if (( ${{#reply}} )); then
        _describe -t commands 'spiderflow command' reply
    elif [[ $pos == __files__ ]]; then
        _files
    elif [[ $pos == __jobs__ ]]; then
        compadd -- ${{=$(spiderflow completion --job-ids 2>/dev/null)}}
    elif [[ -n $pos ]]; then
        compadd -- ${{=pos}}
    fi
}}

if (( $+functions[compdef] )); then
    compdef _spiderflow spiderflow
else
    print -u2 "spiderflow completion: run 'autoload -U compinit && compinit' before sourcing this script"
fi
"""


# fish: the command path is computed from `commandline -opc` like the bash script's; one function prints
# the candidates (with descriptions after a tab).
_FISH = r"""# fish completion for spiderflow (generated by `spiderflow completion fish`).
# Install: spiderflow completion fish > ~/.config/fish/completions/spiderflow.fish

{tables}

function __spiderflow_candidates
    set -l tokens (commandline -opc)
    set -l cur (commandline -ct)
    set -l cmdpath ""
    set -l skip 0
    for w in $tokens[2..-1]
        if test $skip -eq 1
            set skip 0
            continue
        end
        if string match -q -- '-*' $w
            set -l valued (string split ' ' -- (__spiderflow_valued "$cmdpath"))
            if not string match -q -- '*=*' $w; and contains -- $w $valued
                set skip 1
            end
            continue
        end
        if contains -- $w (string split ' ' -- (__spiderflow_subs "$cmdpath"))
            set cmdpath (string trim -- "$cmdpath $w")
        end
    end
    set -l prev $tokens[-1]
    if string match -q -- '-*' $prev; and contains -- $prev (string split ' ' -- (__spiderflow_valued "$cmdpath"))
        set -l words (__spiderflow_choices "$cmdpath" "$prev")
        test -n "$words"; and string split ' ' -- $words
        set -l files (__spiderflow_files "$cmdpath" "$prev")
        test -n "$files"; and __fish_complete_path $cur
        return
    end
    if string match -q -- '-*' $cur
        string split ' ' -- (__spiderflow_opts "$cmdpath")
        return
    end
    set -l described (__spiderflow_described "$cmdpath")
    set -l pos (__spiderflow_positional "$cmdpath")
    if test -n "$described"
        printf '%s\n' $described
    else if test "$pos" = __files__
        __fish_complete_path $cur
    else if test "$pos" = __jobs__
        spiderflow completion --job-ids 2>/dev/null
    else if test -n "$pos"
        string split ' ' -- $pos
    end
end

complete -c spiderflow -f -a '(__spiderflow_candidates)'
"""


def _fish_tables(root: Node) -> str:
    """The bash tables as fish functions (``switch``), plus subcommands with their help (``name<TAB>help``)."""
    nodes = _walk(root)

    def fn(name: str, key: str, cases: list[tuple[str, str]]) -> str:
        body = [f"        case {_fish_quote(k)}\n            echo {_fish_quote(v)}" for k, v in cases]
        return "\n".join([f"function __spiderflow_{name}", f"    switch {key}", *body, "    end", "end"])

    subs = [(p, " ".join(n.subs)) for p, n in nodes if n.subs]
    opts = [(p, " ".join(n.options)) for p, n in nodes]
    valued = [(p, " ".join(sorted(n.valued))) for p, n in nodes if n.valued]
    choices = [(f"{p}|{o}", " ".join(v)) for p, n in nodes for o, v in n.choices.items()]
    files = [(f"{p}|{o}", "1") for p, n in nodes for o in sorted(n.files)]
    pos = [(p, " ".join(n.positional_choices) if n.positional_choices else "__files__") for p, n in nodes
           if n.positional_choices or (n.positional_files and not n.subs)]
    described = []
    for p, n in nodes:
        if n.subs:
            lines = "\n".join(f"            printf '%s\\t%s\\n' {_fish_quote(name)} {_fish_quote(' '.join(h.split()))}"
                              for name, (h, _n) in n.subs.items())
            described.append(f"        case {_fish_quote(p)}\n{lines}")
    parts = [fn("subs", '"$argv[1]"', subs), fn("opts", '"$argv[1]"', opts), fn("valued", '"$argv[1]"', valued),
             fn("choices", '"$argv[1]|$argv[2]"', choices), fn("files", '"$argv[1]|$argv[2]"', files),
             fn("positional", '"$argv[1]"', pos),
             "\n".join(["function __spiderflow_described", '    switch "$argv[1]"', *described, "    end", "end"])]
    return "\n\n".join(parts)


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render(shell: str, parser: argparse.ArgumentParser | None = None) -> str:
    """The completion script for ``shell`` (``bash``, ``zsh`` or ``fish``) of ``parser`` (default: the CLI's)."""
    if parser is None:
        from spiderflow.cli.main import build_parser

        parser = build_parser()
    root = command_tree(parser)
    if shell == "fish":
        return _FISH.format(tables=_fish_tables(root))
    template = _BASH if shell == "bash" else _ZSH
    return template.format(tables=_tables(root, zsh=shell == "zsh"))


def _job_ids() -> int:
    """The job ids of the current context's scheduler, one a line (nothing when it does not answer)."""
    from spiderflow.core.errors import SpiderFlowError
    from spiderflow.sdk import Client

    try:
        with Client(timeout_s=5.0) as sf:
            ids = [j.id for j in sf.list()]
    except SpiderFlowError:
        return 0
    sys.stdout.write("".join(f"{i}\n" for i in ids))
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.job_ids:
        return _job_ids()
    if args.shell is None:
        from spiderflow.cli.common import EXIT_USAGE, CliError

        raise CliError("give a shell: bash, zsh or fish (see spiderflow completion --help)", EXIT_USAGE)
    sys.stdout.write(render(args.shell))
    sys.stdout.flush()
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("completion", help="print a shell completion script (bash, zsh or fish)",
                       description="Print a completion script; install with: source <(spiderflow completion bash)",
                       epilog="example: spiderflow completion fish > ~/.config/fish/completions/spiderflow.fish")
    p.add_argument("shell", choices=SHELLS, nargs="?", help="the shell to complete in")
    p.add_argument("--job-ids", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=_run)
