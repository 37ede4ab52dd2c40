# ReFrame checks of twobp: the pipeline benchmark (2BP against standard backprop, every schedule) and the
# llama_pipeline example (it trains). They run the programs of an existing build (-S twobp_build_dir=DIR, default
# <repository>/build); building twobp is the centre's own recipe (README "Quick start").
#
#   reframe -c benchmarks/reframe -r                                   # this machine: ReFrame's generic system
#   reframe -C benchmarks/reframe/config.py -c benchmarks/reframe -r   # the systems of config.py (a Slurm example)
#
# Sanity: the JSON each program writes is there and complete; the benchmark's 2BP is at least as fast as standard
# backprop: the geometric mean of speedup_vs_standard over the schedules >= min_mean_speedup (1.0), and every
# schedule's >= min_speedup (0.95 by default: on a shared machine one schedule's standard and 2BP runs, which follow
# each other rather than alternate, were seen 1 % apart the wrong way; give -S min_speedup=1.0 on quiet nodes);
# the example's loss falls. Performance: tokens/s per schedule and mode, and the example's tokens/s, against the references of
# references.py for the system:partition the check runs on (no reference: reported, not judged).
import json
import math
import os

import reframe as rfm
import reframe.utility.sanity as sn
import reframe.utility.udeps as udeps
from reframe.core.exceptions import SanityError

from references import REFERENCES

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))


def _launched_locally(test):
    '''Whether the partition starts programs directly (ReFrame's local launcher): twobp then runs its ranks as
    threads of one process; any other launcher (srun, mpirun) starts one process per rank.'''
    return test.current_partition.launcher_type.registered_name == 'local'


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SanityError(f'{path}: not written or not JSON ({e})')


class _TwobpCheck(rfm.RunOnlyRegressionTest):
    valid_systems = ['*']
    valid_prog_environs = ['*']
    twobp_build_dir = variable(str, value=os.path.join(REPO, 'build'))
    ranks = variable(int, value=2)
    maintainers = ['twobp']
    tags = {'twobp'}

    def _references(self, names):
        '''references.py's entries of this system:partition for `names` (ReFrame's reference tuples).'''
        system = f'{self.current_system.name}:{self.current_partition.name}'
        mine = REFERENCES.get(system, {})
        return {system: {n: mine[n] for n in names if n in mine}}

    @run_before('run')
    def set_tasks(self):
        if not os.access(self.executable, os.X_OK):
            raise FileNotFoundError(f'{self.executable}: not built; build twobp first (README "Quick start") or '
                                    f'give -S twobp_build_dir=DIR')
        if _launched_locally(self):
            self.num_tasks = 1
        else:
            self.num_tasks = self.ranks
            self.num_tasks_per_node = min(self.ranks, self.current_partition.processor.num_cpus or self.ranks)


@rfm.simple_test
class TwobpPipelineBench(_TwobpCheck):
    '''`twobp_bench pipeline --mode both` on every schedule where 2BP's gain is above this machine's noise.'''
    descr = 'twobp: 2BP against standard backprop, every schedule'
    # GPipe is left out by default: its 2BP gain here (1.011 at m = 4, docs/BENCHMARKS.md) is inside the
    # run-to-run noise of a shared machine (-S schedules=gpipe,1f1b,... adds it).
    schedules = variable(str, value='1f1b,interleaved-1f1b,zb-h1,zb-h2,zb-v')
    microbatches = variable(int, value=8)
    steps = variable(int, value=6)
    min_speedup = variable(float, value=0.95)
    min_mean_speedup = variable(float, value=1.0)

    @run_after('init')
    def set_command(self):
        self.executable = os.path.join(self.twobp_build_dir, 'benchmarks', 'twobp_bench')
        self.executable_opts = ['pipeline', '--schedule', self.schedules, '--mode', 'both', '--ranks',
                                str(self.ranks), '--microbatches', str(self.microbatches), '--steps',
                                str(self.steps), '--warmup', '2', '--json', 'pipeline.json']

    @run_before('performance')
    def set_perf_variables(self):
        names = [f'{s}_{m}_tokens_per_s' for s in self.schedules.split(',') for m in ('standard', '2bp')]
        self.perf_variables = {
            n: sn.make_performance_function(self._tokens_per_s, 'tokens/s', n) for n in names
        }
        self.reference = self._references(names)

    def _tokens_per_s(self, name):
        doc = _read_json(os.path.join(self.stagedir, 'pipeline.json'))
        for r in doc['results']:
            if f"{r['schedule']}_{r['mode']}_tokens_per_s" == name:
                return r['tokens_per_s']
        raise SanityError(f'pipeline.json has no result for {name}')

    @sanity_function
    def validate(self):
        return sn.all([sn.assert_found(r'wrote pipeline\.json', self.stdout), self._check_results()])

    @sn.deferrable
    def _check_results(self):
        doc = _read_json(os.path.join(self.stagedir, 'pipeline.json'))
        problems, speedups = [], []
        for s in self.schedules.split(','):
            rows = {r['mode']: r for r in doc['results'] if r['schedule'] == s}
            if set(rows) != {'standard', '2bp'}:
                problems.append(f'{s}: results for {sorted(rows)}, expected standard and 2bp')
                continue
            speedup = rows['2bp'].get('speedup_vs_standard', 0)
            speedups.append(speedup)
            if speedup < self.min_speedup:
                problems.append(f'{s}: 2BP speedup {speedup:.3f} < {self.min_speedup}')
        if speedups and all(x > 0 for x in speedups):
            mean = math.prod(speedups) ** (1 / len(speedups))
            if mean < self.min_mean_speedup:
                problems.append(f'2BP speedup over the schedules (geometric mean) {mean:.3f} < '
                                f'{self.min_mean_speedup}')
        if problems:
            raise SanityError('; '.join(problems))
        return True


@rfm.simple_test
class TwobpExample(_TwobpCheck):
    '''The llama_pipeline example trains: its loss falls over the run.'''
    descr = 'twobp: llama_pipeline example, loss falls'
    model = variable(str, value='tiny')
    schedule = variable(str, value='zb-h1')
    steps = variable(int, value=30)

    @run_after('init')
    def set_command(self):
        # After the benchmark, not beside it: both measure throughput and would share the cores.
        self.depends_on('TwobpPipelineBench', how=udeps.by_env)
        self.executable = os.path.join(self.twobp_build_dir, 'examples', 'llama_pipeline')

    @run_before('run')
    def set_options(self):
        device = self.current_partition.extras.get('twobp_device', 'cpu')
        self.executable_opts = ['--model', self.model, '--ranks', str(self.ranks), '--schedule', self.schedule,
                                '--steps', str(self.steps), '--device', device, '--json', 'example.json']

    @run_before('performance')
    def set_perf_variables(self):
        self.perf_variables = {
            'tokens_per_s': sn.make_performance_function(self._tokens_per_s, 'tokens/s'),
        }
        self.reference = self._references(['tokens_per_s'])

    def _steps(self):
        return _read_json(os.path.join(self.stagedir, 'example.json'))['steps']

    def _tokens_per_s(self):
        later = [s['tokens_per_s'] for s in self._steps()[1:]]  # the first step pays for warm-up
        return sorted(later)[len(later) // 2]

    @sanity_function
    def validate(self):
        return self._check_loss()

    @sn.deferrable
    def _check_loss(self):
        steps = self._steps()
        if len(steps) != self.steps:
            raise SanityError(f'example.json has {len(steps)} steps, expected {self.steps}')
        first, last = steps[0]['loss'], steps[-1]['loss']
        if not last < first:
            raise SanityError(f'the loss did not fall: {first:.4f} at step 1, {last:.4f} at step {self.steps}')
        return True
