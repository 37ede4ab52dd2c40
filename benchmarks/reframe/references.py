# Performance references of benchmarks/reframe/twobp_checks.py, per 'system:partition':
#   name: (value, lower, upper, unit), lower/upper as fractions of value (ReFrame's reference tuples; None: no bound).
# A system:partition without an entry is reported, not judged. Add your centre's from a quiet run of the checks
# (the perflogs ReFrame writes hold the values).
#
# generic:default is this project's CPU machine (2 cores, no GPU; ReFrame's built-in system, what
# `reframe -c benchmarks/reframe -r` uses without -C): the median of three runs of that command on 2026-12-02
# (02:28-02:33 UTC; the example's from one run). The lower bounds are wide (-35 %) because the machine is shared:
# one configuration's tokens/s moved by up to 25 % between runs. local:default (config.py) is the same machine.
_THIS_MACHINE = {
        '1f1b_standard_tokens_per_s': (3652, -0.35, None, 'tokens/s'),
        '1f1b_2bp_tokens_per_s': (4315, -0.35, None, 'tokens/s'),
        'interleaved-1f1b_standard_tokens_per_s': (4456, -0.35, None, 'tokens/s'),
        'interleaved-1f1b_2bp_tokens_per_s': (4622, -0.35, None, 'tokens/s'),
        'zb-h1_standard_tokens_per_s': (4182, -0.35, None, 'tokens/s'),
        'zb-h1_2bp_tokens_per_s': (4405, -0.35, None, 'tokens/s'),
        'zb-h2_standard_tokens_per_s': (3938, -0.35, None, 'tokens/s'),
        'zb-h2_2bp_tokens_per_s': (4378, -0.35, None, 'tokens/s'),
        'zb-v_standard_tokens_per_s': (4596, -0.35, None, 'tokens/s'),
        'zb-v_2bp_tokens_per_s': (4805, -0.35, None, 'tokens/s'),
        'tokens_per_s': (10876, -0.35, None, 'tokens/s'),  # TwobpExample
}
REFERENCES = {
    'generic:default': _THIS_MACHINE,
    'local:default': _THIS_MACHINE,
}
