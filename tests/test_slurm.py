"""`lmbook slurm` as cluster users write it, without a cluster: the script passes `bash -n`, every `#SBATCH`
line is one of sbatch's documented options with a value sbatch accepts, and the script's body runs with fakes
of `srun`, `scontrol` and `lmbook` on PATH: each node's task gets its own rank and the rendezvous, overrides
arrive as typed, and the time-limit signal asks the run to checkpoint and stop, then requeues the job."""
import os, re, shlex, signal, subprocess, time
from pathlib import Path
import pytest
from lmbook.cli import main
from lmbook.pods.slurm import SlurmJob, check, job_plan, slurm_script, time_seconds

# sbatch's long options, as Slurm's sbatch documentation lists them (slurm.schedmd.com/sbatch.html, 24.x)
SBATCH_OPTIONS = set('''account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment
constraint container container-id contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task
deadline delay-boot dependency distribution error exclude exclusive export export-file extra extra-node-info
get-user-env gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags help hint
hold ignore-pbs input job-name kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind
mem-per-cpu mem-per-gpu mincpus network nice no-kill no-requeue nodefile nodelist nodes ntasks ntasks-per-core
ntasks-per-gpu ntasks-per-node ntasks-per-socket oom-kill-step open-mode output overcommit oversubscribe
parsable partition power prefer priority profile propagate qos quiet reboot requeue reservation resv-ports
segment signal sockets-per-node spread-job switches test-only thread-spec threads-per-core time time-min tmp
tres-bind tres-per-task uid usage use-min-nodes verbose version wait wait-all-nodes wckey wrap'''.split())
FLAGS = {'requeue', 'no-requeue', 'contiguous', 'hold', 'ignore-pbs', 'overcommit', 'parsable', 'quiet',
         'reboot', 'spread-job', 'test-only', 'use-min-nodes', 'wait'}  # options that take no value
# the values sbatch accepts for the options lmbook writes
VALUES = {'nodes': r'[1-9]\d*', 'ntasks-per-node': r'[1-9]\d*', 'cpus-per-task': r'[1-9]\d*',
          'gpus-per-node': r'([A-Za-z0-9_.-]+:)?[1-9]\d*', 'open-mode': r'append|truncate',
          'signal': r'([RB]:)?(\d+|(SIG)?[A-Z0-9]+)(@\d+)?', 'mem': r'\d+[KMGT]?', 'job-name': r'\S+',
          'output': r'\S+', 'partition': r'[\w.,-]+', 'account': r'[\w.-]+', 'qos': r'[\w.-]+',
          'constraint': r'\S+'}

JOB = dict(nodes=4, gpus_per_node='h100:8', parallel='hsdp', partition='gpu-h100', account='proj42',
           qos='high', constraint='h100&ib', mem='480G', time='2-00:00:00', modules='cuda/12.4 python/3.11',
           venv='$HOME/venvs/lmbook', workspace='/scratch/$USER/lmbook',
           overrides=dict(lr='1e-4', sample_prompts="It's a \"test\"; $HOME stays"))


def sbatch_options(txt:str) -> list[tuple[str, str|None]]:
    "(option, value) of each `#SBATCH` line, checking that they all come before the first command."
    lines = txt.splitlines()
    first = next(i for i, l in enumerate(lines) if l.strip() and not l.startswith('#'))
    late = [l for l in lines[first:] if l.startswith('#SBATCH')]
    assert not late, f"sbatch ignores an #SBATCH line after a command: {late}"
    out = []
    for l in lines[:first]:
        if not l.startswith('#SBATCH'): continue
        m = re.fullmatch(r'#SBATCH --([a-z-]+)(?:=(\S+))?', l)
        assert m, f"not one long option: {l!r}"
        out.append((m[1], m[2]))
    return out


def test_sbatch_lines_are_documented_options_with_valid_values():
    txt = slurm_script(SlurmJob('runpod_2b', 'fw-2b', **JOB))
    opts = sbatch_options(txt)
    names = [k for k, _ in opts]
    assert len(names) == len(set(names)) and set(names) <= SBATCH_OPTIONS, set(names) - SBATCH_OPTIONS
    for k, v in opts:
        assert (v is None) == (k in FLAGS), (k, v)
        if k in VALUES: assert re.fullmatch(VALUES[k], v), (k, v)
        if k == 'time': assert time_seconds(v) == 2*86400
    assert dict(opts)['signal'] == 'B:USR1@300' and 'requeue' in names and dict(opts)['open-mode'] == 'append'
    assert ('gpus-per-node', 'h100:8') in opts and ('constraint', 'h100&ib') in opts
    # the check itself would catch an option sbatch does not know
    with pytest.raises(AssertionError): sbatch_options('#!/bin/bash\n#SBATCH --gpus_per_node=8\necho\n')
    with pytest.raises(AssertionError):
        assert {k for k, _ in sbatch_options('#SBATCH --walltime=1:00:00\necho\n')} <= SBATCH_OPTIONS


def fakes(tmp_path:Path, lmbook:str) -> dict:
    "The environment of a batch script run with fakes of srun (a task a node), scontrol and `lmbook`."
    b = tmp_path/'bin'
    b.mkdir()
    bodies = dict(
        srun='while [ "${1#--}" != "$1" ]; do shift; done\nrc=0; i=0; pids=""\n'
             'while [ $i -lt "$SLURM_NNODES" ]; do SLURM_NODEID=$i "$@" & pids="$pids $!"; i=$((i+1)); done\n'
             'for p in $pids; do wait $p || rc=$?; done\nexit $rc',
        scontrol='case "$1" in show) echo node-a ;; requeue) echo "requeue $2" >> "$REC" ;; esac',
        lmbook=lmbook, module='exit 0')
    for name, body in bodies.items():
        (b/name).write_text(f'#!/bin/sh\n{body}\n')
        (b/name).chmod(0o755)
    return dict(os.environ, PATH=f"{b}:{os.environ['PATH']}", SLURM_NNODES='2', SLURM_JOB_ID='7',
                SLURM_JOB_NODELIST='node-[a-b]', OUT=str(tmp_path/'args'), REC=str(tmp_path/'rec'), HOME='/h',
                USER='me', BASH_ENV='')


def test_script_is_valid_bash_and_each_node_gets_its_rank_and_the_overrides_as_typed(tmp_path):
    job = SlurmJob('runpod_2b', 'fw-2b', **{**JOB, 'nodes': 2, 'venv': '', 'workspace': str(tmp_path/'ws')})
    script = tmp_path/'train.sbatch'
    script.write_text(slurm_script(job))
    assert subprocess.run(['bash', '-n', str(script)]).returncode == 0
    env = fakes(tmp_path, 'printf "%s\\n" "$@" > "$OUT.$SLURM_NODEID"\nenv > "$OUT.env.$SLURM_NODEID"')
    assert subprocess.run(['bash', str(script)], env=env, timeout=30).returncode == 0
    for node in (0, 1):
        args = (tmp_path/f'args.{node}').read_text().splitlines()
        targs = args[args.index('--torchrun-args') + 1]
        assert (f'--node-rank={node} ' in targs and '--rdzv-endpoint=node-a:20007' in targs
                and '--nnodes=2' in targs and '--rdzv-id=7' in targs), targs
        assert args[:9] == ['train', '--profile', 'runpod_2b', '--experiment', 'fw-2b', '--nproc', '8',
                            '--parallel', 'hsdp']
        assert '--set=sample_prompts=It\'s a "test"; $HOME stays' in args and '--set=lr=1e-4' in args
        seen = dict(l.split('=', 1) for l in (tmp_path/f'args.env.{node}').read_text().splitlines()
                    if '=' in l)
        assert seen['HF_HUB_OFFLINE'] == seen['HF_DATASETS_OFFLINE'] == '1'
        assert seen['WANDB_MODE'] == 'offline'
        assert seen['LMBOOK_WORKSPACE'] == str(tmp_path/'ws')
    assert not (tmp_path/'rec').exists()  # finished: nothing requeued


def test_the_time_limit_signal_checkpoints_the_run_and_requeues_the_job(tmp_path):
    "USR1 to the batch shell (`B:`) writes the run's stop request; the run stops (143); the job requeues."
    ws = tmp_path/'ws'
    job = SlurmJob('runpod_2b', 'fw-2b', nodes=2, gpus_per_node='8', workspace=str(ws))
    script = tmp_path/'train.sbatch'
    script.write_text(slurm_script(job))
    stop = ws/'runs'/'fw-2b'/'STOP'
    stop.parent.mkdir(parents=True)
    # each node's trainer: running until the stop request, which rank 0 takes; then the stop's exit code
    env = fakes(tmp_path, f'touch "$OUT.$SLURM_NODEID"\nwhile [ ! -e {stop} ] && [ ! -e "$OUT.took" ]; do '
                          f'sleep 0.05; done\ntouch "$OUT.took"\nrm -f {stop}\nexit 143')
    p = subprocess.Popen(['bash', str(script)], env=env, start_new_session=True)
    try:
        t0 = time.time()
        while not all((tmp_path/f'args.{n}').exists() for n in (0, 1)):
            assert time.time() - t0 < 20 and p.poll() is None
            time.sleep(0.05)
        p.send_signal(signal.SIGUSR1)  # to the batch shell alone, as `--signal=B:USR1` sends it
        assert p.wait(20) == 143
    finally:
        if p.poll() is None: os.killpg(p.pid, signal.SIGKILL)
    assert (tmp_path/'rec').read_text() == 'requeue 7\n' and not stop.exists()


def test_bad_values_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    for kw, said in [(dict(partition='gpu; rm -rf ~'), '--partition'),
                     (dict(workspace='/scratch/my runs'), 'no spaces'),
                     (dict(venv='/opt/$(id)/venv'), '--venv'), (dict(gpus_per_node='h100'), 'h100:4'),
                     (dict(time='24h'), 'HH:MM:SS'), (dict(signal_before=30), '--signal-before'),
                     (dict(overrides=dict(lerning_rate='1')), 'lerning_rate'),
                     (dict(parallel='zero3'), 'zero3')]:
        with pytest.raises(ValueError, match=re.escape(said)): check(SlurmJob('runpod_2b', 'fw-2b', **kw))
    # a job whose estimate does not fit its card is refused, naming what would
    with pytest.raises(ValueError, match='use --parallel'):
        job_plan(SlurmJob('runpod_4b', 'fw-4b', nodes=2, gpus_per_node='a100:8', parallel='ddp',
                          overrides=dict(batch_fit='false')))
    out = tmp_path/'x.sbatch'
    assert main(['slurm', '-p', 'runpod_2b', '-e', 'bad name', '--out', str(out)]) == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err.startswith('error:') and len(err.strip().splitlines()) == 1


def test_out_prints_the_plan_and_the_rules_then_the_next_steps(tmp_path, capsys):
    out = tmp_path/'train.sbatch'
    assert main(['slurm', '-p', 'runpod_2b', '-e', 'fw-2b', '-N', '4', '--gpus-per-node', 'h100:8',
                 '--parallel', 'hsdp', '--out', str(out), 'lr=1e-4']) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith('run    runpod_2b (1.99B parameters) on 4 node(s) x 8 GPU(s), hsdp: 4,194,304')
    assert said[1].startswith('memory ~') and said[2].startswith('time   ~')
    # 32 GPUs at the profile's accumulation: 3.2x the rule's batch, and what grad_accum would keep to it
    assert any(l.startswith('rules  batch:') and 'grad_accum=5' in l for l in said), said
    assert said[-1].startswith(f'wrote {out}: first lmbook prepare --profile runpod_2b --experiment fw-2b')
    assert '# rules  batch:' in out.read_text()


def test_the_readme_shows_what_its_slurm_command_prints(tmp_path, capsys, monkeypatch):
    "The README's cluster section: its `lmbook slurm` command, run now, prints what the README shows."
    from conftest import ROOT
    txt = (ROOT/'README.md').read_text()
    m = re.search(r'```bash\n(lmbook slurm .*?)\n```\n```\n(.*?)\n```', txt, re.S)
    assert m, 'no lmbook slurm command and output in the README'
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(m[1].replace('\\\n', ' '))[1:]) == 0
    assert capsys.readouterr().out.rstrip('\n') == m[2]
