# ReFrame configuration for twobp's checks (benchmarks/reframe/twobp_checks.py):
#
#   reframe -C benchmarks/reframe/config.py -c benchmarks/reframe -r
#
# Two systems; ReFrame picks the first whose `hostnames` matches the machine it runs on (or --system NAME:PART):
#  - 'cluster': a Slurm GPU cluster, to adapt: hostnames, the partitions' --partition/--account/--gres access
#    options, and the environment (modules) that has twobp's runtime (LibTorch, CUDA, NCCL, MPI). Its 'gpu'
#    partition runs the example with --device cuda (extras.twobp_device) as one process per GPU under srun; its
#    'cpu' partition runs both checks as one process per rank.
#  - 'local': any other machine (this project's CPU machine included), one job at a time so that the throughput
#    checks do not share cores.
# Without -C, ReFrame's built-in 'generic' system is used, as on this project's CPU machine.
site_configuration = {
    'systems': [
        {
            'name': 'cluster',
            'descr': 'Slurm GPU cluster (example: adapt hostnames, access and environments)',
            'hostnames': [r'^login\d+', r'^gpu-node\d+'],
            'modules_system': 'nomod',
            'partitions': [
                {
                    'name': 'gpu',
                    'descr': '4 GPUs per node, one rank per GPU',
                    'scheduler': 'slurm',
                    'launcher': 'srun',
                    'access': ['--partition=gpu', '--gres=gpu:4', '--exclusive'],
                    'environs': ['twobp'],
                    'max_jobs': 4,
                    'processor': {'num_cpus': 64},
                    'devices': [{'type': 'gpu', 'num_devices': 4}],
                    'features': ['gpu'],
                    'extras': {'twobp_device': 'cuda'},
                    'time_limit': '30m',
                },
                {
                    'name': 'cpu',
                    'descr': 'CPU nodes, one rank per process',
                    'scheduler': 'slurm',
                    'launcher': 'srun',
                    'access': ['--partition=cpu', '--exclusive'],
                    'environs': ['twobp'],
                    'max_jobs': 4,
                    'processor': {'num_cpus': 64},
                    'features': ['cpu'],
                    'time_limit': '30m',
                },
            ],
        },
        {
            'name': 'local',
            'descr': 'this machine, one job at a time',
            'hostnames': [r'.*'],
            'modules_system': 'nomod',
            'partitions': [
                {
                    'name': 'default',
                    'scheduler': 'local',
                    'launcher': 'local',
                    'environs': ['twobp'],
                    'max_jobs': 1,
                    'features': ['cpu'],
                },
            ],
        },
    ],
    'environments': [
        {
            'name': 'twobp',
            # On a cluster: the modules (or a prefix in `env_vars`) that provide LibTorch's, CUDA's and NCCL's
            # shared libraries to twobp's programs, e.g. 'modules': ['cuda/12.4', 'openmpi/5.0'].
            'modules': [],
            'env_vars': [],
        },
    ],
}
