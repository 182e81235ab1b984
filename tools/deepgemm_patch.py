"""Patch a DeepGEMM 2.6.1 source tree before building it, for images where its first GEMM crashes in the kernel
compiler's include scan (a segmentation fault inside ``std::regex``, seen with torch 2.11 + CUDA 13.0:
benchmarks/results/deepgemm_build_h100_20261206.md). Usage: ``python tools/deepgemm_patch.py DEEPGEMM_ROOT``, then
DeepGEMM's own build (docs/moe.md, "Blockwise details").

- csrc/jit/include_parser.hpp: the include scan without ``std::regex`` (the crash site), the same matches: ``#``,
  blanks, ``include``, blanks, ``<`` or ``"``, one or more characters other than ``>`` and ``"``, then ``>`` or ``"``;
- setup.py: the module's symbols hidden (``-fvisibility=hidden``) and bound to its own definitions at link time
  (``-Wl,-Bsymbolic``), so that libstdc++ template instantiations exported by libtorch cannot stand in for its own.

Idempotent; prints what it changed."""
import pathlib
import sys

SCAN = r'''        std::vector<std::string> matches;
        const auto past_blanks = [&code](size_t i) {  // (the regex's \s: space, \t, \n, \r, \f, \v)
            while (i < code.size() and std::string(" \t\n\r\f\v").find(code[i]) != std::string::npos) ++ i;
            return i;
        };
        for (size_t pos = code.find('#'); pos != std::string::npos; pos = code.find('#', pos + 1)) {
            size_t i = past_blanks(pos + 1);
            if (code.compare(i, 7, "include") != 0) continue;
            i = past_blanks(i + 7);
            if (i >= code.size() or (code[i] != '<' and code[i] != '"')) continue;
            size_t j = i + 1;
            while (j < code.size() and code[j] != '>' and code[j] != '"') ++ j;
            if (j == i + 1 or j >= code.size()) continue;
            matches.push_back(code.substr(pos, j + 1 - pos));
            pos = j;
        }
        for (const auto& include_str: matches) {
'''
REGEX_START = "        const std::regex pattern("
REGEX_LAST = "            const auto include_str = iter->str();\n"


def patch_setup(text: str) -> str:
    if "fvisibility=hidden" not in text:
        text = text.replace("cxx_flags = ['-std=c++17'", "cxx_flags = ['-fvisibility=hidden', "
                            "'-fvisibility-inlines-hidden', '-std=c++17'", 1)
    if "extra_link_args" not in text:
        text = text.replace("extra_compile_args=cxx_flags)", "extra_compile_args=cxx_flags,\n"
                            "                          extra_link_args=['-Wl,-Bsymbolic', "
                            "'-Wl,--exclude-libs,ALL'])", 1)
    return text


def patch_parser(text: str) -> str:
    """The regex loop's head (from the pattern to the match's string) replaced by the scan; the loop's body kept."""
    start, last = text.find(REGEX_START), text.find(REGEX_LAST)
    if start >= 0 and last > start:
        text = text[:start] + SCAN + text[last + len(REGEX_LAST):]
    return text


def main(argv: list) -> int:
    root = pathlib.Path(argv[0]) if len(argv) == 1 else None
    files = [root / "setup.py", root / "csrc" / "jit" / "include_parser.hpp"] if root else []
    if not files or not all(f.is_file() for f in files):
        print("usage: python tools/deepgemm_patch.py DEEPGEMM_ROOT (the root of a DeepGEMM 2.6.1 checkout)")
        return 2
    setup, parser = files
    s, p = patch_setup(setup.read_text()), patch_parser(parser.read_text())
    setup.write_text(s)
    parser.write_text(p)
    print("setup.py: hidden visibility", "fvisibility=hidden" in s, "link args", "extra_link_args" in s)
    print("include_parser.hpp: std::regex gone", "std::regex pattern" not in p)
    return 0 if "std::regex pattern" not in p else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
