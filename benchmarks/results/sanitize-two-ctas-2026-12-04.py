"""One-off: unsplit short-context decodes (two CTAs per SM) into NaN-poisoned outputs against float64; run it under
compute-sanitizer."""
from foscar import Scheme
from foscar.hopper.decode import KERNELS
from foscar.testing import check_decode

for scheme in (Scheme.make(2, "token", 128, "token", 128, 128, 4), Scheme.make(4, "token", 128, "token", 128, 128, 4)):
    assert KERNELS.launch_options(scheme, 1, 2048 + 128, 1) == {"consumers": 1, "ctas_per_sm": 2}
    acc = check_decode(scheme, lengths=[1, 65, 1000, 2049] * 40)
    print(scheme.name, "two CTAs per SM", acc, "ok" if acc.ok else "FAILED", flush=True)
