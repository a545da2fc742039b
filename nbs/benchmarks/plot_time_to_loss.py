"""Validation loss against training wall time and against tokens, one line per run of time_to_loss.py.

Usage: python3 nbs/benchmarks/plot_time_to_loss.py ROWS.jsonl OUT.png
"""
import json, sys
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt

def main(rows_path, png):
    rows = [json.loads(l) for l in open(rows_path) if l.strip()]
    runs = {}
    for r in rows:
        if not r.get('summary'): runs.setdefault(r['run'], []).append(r)
    target = next((r['target'] for r in rows if r.get('summary') and r.get('target')), None)
    fig, axs = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for name, rs in runs.items():
        rs = [r for r in rs if r['step'] > 0]
        axs[0].plot([r['train_s'] for r in rs], [r['val_loss'] for r in rs], label=name)
        axs[1].plot([r['tokens']/1e6 for r in rs], [r['val_loss'] for r in rs], label=name)
    for ax, xl in zip(axs, ('training wall time (s, compilation and evaluation excluded)', 'tokens (M)')):
        if target: ax.axhline(target, color='gray', ls=':', lw=1)
        ax.set_xlabel(xl); ax.grid(alpha=.3)
    axs[0].set_ylabel('validation loss'); axs[1].legend()
    lo = min(r['val_loss'] for rs in runs.values() for r in rs)
    axs[0].set_ylim(lo - 0.1, lo + 2.5)
    fig.tight_layout(); fig.savefig(png, dpi=110)

if __name__ == '__main__': main(*sys.argv[1:3])
