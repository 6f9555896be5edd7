"""Prints examples/quant_speed.sh's results (TSV rows: model, type, config, phase, tokens/s) as
one markdown table: tokens/s of llama.cpp and of wgpar's packed and dense runs, and the ratios
issue 34 targets. A figure that was not measured prints n/a, and so does every ratio using it.

Usage: python quant_speed_table.py RESULTS.tsv
"""
import sys


def load(path):
    rates, order, configs = {}, [], set()
    with open(path) as f:
        for line in f:
            model, qtype, config, phase, value = line.rstrip("\n").split("\t")
            if (model, qtype) not in order:
                order.append((model, qtype))
            configs.add(config)
            try:
                rates[(model, qtype, config, phase)] = float(value)
            except ValueError:
                pass
    return rates, order, configs


def fmt(v, digits=1):
    return "n/a" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def main():
    rates, order, configs = load(sys.argv[1])
    parallel = [c for c in ("tp2", "pp2") if f"{c}-packed" in configs or f"{c}-dense" in configs]
    head = ["model", "file", "llama.cpp pp / tg", "packed pp / tg", "dense pp / tg",
            "packed/dense tg (>= 1.0)", "packed/llama tg (>= 1.5)",
            "packed/llama pp (>= 1.5)", "packed/dense pp (>= 0.8)"]
    for c in parallel:
        head += [f"{c.upper()} packed pp / tg", f"{c.upper()} dense pp / tg",
                 f"{c.upper()} packed/dense tg, pp"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for model, qtype in order:
        def get(config, phase):
            return rates.get((model, qtype, config, phase))

        def pair(config):
            return f"{fmt(get(config, 'pp'))} / {fmt(get(config, 'tg'), 2)}"

        cells = [model, qtype, pair("llama.cpp"), pair("single-packed"), pair("single-dense")]
        for num, den, phase in [("single-packed", "single-dense", "tg"),
                                ("single-packed", "llama.cpp", "tg"),
                                ("single-packed", "llama.cpp", "pp"),
                                ("single-packed", "single-dense", "pp")]:
            cells.append(fmt(ratio(get(num, phase), get(den, phase)), 2))
        for c in parallel:
            p, d = f"{c}-packed", f"{c}-dense"
            tg, pp = ratio(get(p, "tg"), get(d, "tg")), ratio(get(p, "pp"), get(d, "pp"))
            cells += [pair(p), pair(d), f"{fmt(tg, 2)}, {fmt(pp, 2)}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
