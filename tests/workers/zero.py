"""The same run at zero_stage 0, 1 and 2, one after the other in one process
of a cluster (the strategy is the process's one).

    tfmulti launch --num_workers 2 -- python zero.py OUT_DIR
        # each stage's run folder: OUT_DIR/stageK (metrics.json, model.keras);
        # every worker prints `stage K: BYTES` (its optimizer state's bytes)
"""

import sys

import tfmulti

if __name__ == "__main__":
    out = sys.argv[1]
    for stage in (0, 1, 2):
        metrics = tfmulti.train(tfmulti.TrainConfig(
            distribution="multi_worker", dataset="synthetic", num_examples=256, epochs=2,
            global_batch_size=32, model="mlp", zero_stage=stage, accumulate_steps=2,
            model_dir=f"{out}/stage{stage}", verbose=0))
        print(f"stage {stage}: {sum(metrics.get('optimizer_state_bytes', {}).values())}",
              flush=True)
