"""The tests of the benchmark suites, the fault campaign, the simulated hosts
and the GPU check harness (checkout-only, like `benchmarks`)."""
