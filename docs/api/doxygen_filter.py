#!/usr/bin/env python3
"""Doxygen's INPUT_FILTER for include/dalle/: the headers document with plain // comments
(the comment above a declaration, or after it on the same line), which Doxygen skips. This
prints a header with those comments as Doxygen's, keeping every line where it was:
- the comment block right after `#pragma once` becomes the file's documentation (@file);
- a comment on lines of its own becomes `///`, the documentation of what follows;
- a comment after a declaration (`int64_t keep = 0;  // K images kept`) becomes `///<`.
A block's first sentence is marked as its brief (@brief ... @details), found here rather
than by Doxygen's JAVADOC_AUTOBRIEF, which ends a brief at any ". ", also in a `code span`,
in parentheses or after "e.g.". Outside code spans, < and > become entities, so that
`<root>/step-<N>` in prose is text, not an HTML tag.
Usage (as Doxygen runs it): doxygen_filter.py HEADER
"""
import re
import sys

OWN_LINE = re.compile(r"^(\s*)//(?!/) ?")
TRAILING = re.compile(r"^(.*[;,])(\s+)//(?!/)\s?(.*)$")
ABBREVIATIONS = ("e.g", "i.e", "etc", "vs", "cf", "approx", "resp", "No")


def convert_block(texts):
    """The lines of one comment block as Doxygen text: entities outside code spans, and
    "@brief" before the block and "@details" after its first sentence (a ". " or a line-ending
    "." outside code spans and parentheses, not after an abbreviation, with text after it)."""
    out, in_code, depth, briefed = [], False, 0, False
    for number, text in enumerate(texts):
        line, i = [], 0
        while i < len(text):
            char = text[i]
            if char == "`":
                in_code = not in_code
            elif not in_code:
                if char == "(":
                    depth += 1
                elif char == ")":
                    depth = max(0, depth - 1)
                elif char == "<":
                    char = "&lt;"
                elif char == ">":
                    char = "&gt;"
                elif char == "." and not briefed and depth == 0:
                    word = re.search(r"(\S*)$", text[:i]).group(1)
                    rest = text[i + 1:]
                    at_end = rest.strip() == "" and any(t.strip() for t in texts[number + 1:])
                    if (rest.startswith(" ") and rest.strip() or at_end) and word not in ABBREVIATIONS:
                        line.append(". @details")
                        briefed = True
                        i += 1
                        continue
            line.append(char)
            i += 1
        out.append("".join(line))
    if out:
        out[0] = "@brief " + out[0]
    return out


def filtered(lines):
    out = list(lines)
    at = 0
    if out and out[0].strip() == "#pragma once" and len(out) > 1 and OWN_LINE.match(out[1]):
        end = 1
        while end < len(out) and OWN_LINE.match(out[end]):
            end += 1
        texts = convert_block([OWN_LINE.sub("", line) for line in out[1:end]])
        out[0] = "/** @file"
        out[1:end] = [text.replace("*/", "* /") for text in texts]
        out[end - 1] += " */"
        at = end
    i = at
    while i < len(out):
        if OWN_LINE.match(out[i]):
            end = i
            while end < len(out) and OWN_LINE.match(out[end]):
                end += 1
            matches = [OWN_LINE.match(line) for line in out[i:end]]
            texts = convert_block([line[match.end():] for line, match in zip(out[i:end], matches)])
            out[i:end] = [f"{match.group(1)}/// {text}" for match, text in zip(matches, texts)]
            i = end
            continue
        match = TRAILING.match(out[i])
        if match and match.group(1).count('"') % 2 == 0 and not match.group(1).lstrip().startswith("#"):
            text = convert_block([match.group(3)])[0].removeprefix("@brief ")
            out[i] = f"{match.group(1)}{match.group(2)}///< {text}"
        i += 1
    return out


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as header:
        text = header.read()
    sys.stdout.write("\n".join(filtered(text.split("\n"))))
