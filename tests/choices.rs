//! The library's plain choices, built the way an example or a test builds them without the
//! CLI: a strategy's options refused by name where they do not apply, a server's lanes
//! against its KV slots, the device counts a choice selects, `compare`'s names resolved and
//! checked, and `run`'s timed generation (fault armed past the warm-up) in one call.

use wgpar::batching::{Length, Rate};
use wgpar::comm::CommConfig;
use wgpar::compare::{CompareChoice, ServeChoice};
use wgpar::device::{parse_virtual, Adapters, DeviceChoice, DeviceSelection, MAX_DEVICES};
use wgpar::load::ModelChoice;
use wgpar::model::hub::ModelRef;
use wgpar::parallel::choice::{parse_counts, Counts, StrategyChoice};
use wgpar::parallel::run_plan::RunChoice;
use wgpar::parallel::timed::TimedRun;
use wgpar::parallel::{build_engine, generate, KeepLogits, Strategy};

fn strategy(name: &str) -> StrategyChoice {
    StrategyChoice {
        strategy: name.into(),
        ..StrategyChoice::default()
    }
}

#[test]
fn options_that_do_not_apply_are_refused_by_name() {
    let cases = [
        (
            "tp",
            StrategyChoice {
                tp: Some(2),
                ..strategy("tp")
            },
            "--tp",
        ),
        (
            "none",
            StrategyChoice {
                micro_batches: Some(2),
                ..strategy("none")
            },
            "--micro-batches",
        ),
        (
            "pp",
            StrategyChoice {
                split: Some(Counts::Given(vec![1, 1])),
                ..strategy("pp")
            },
            "--split",
        ),
        (
            "tp",
            StrategyChoice {
                layers: Some(Counts::Auto),
                ..strategy("tp")
            },
            "--layers",
        ),
    ];
    for (name, choice, option) in cases {
        let err = choice.named(1).expect_err(option).to_string();
        assert!(
            err.contains(option) && err.contains(name),
            "{option}: {err}"
        );
    }
    let both = StrategyChoice {
        layers: Some(Counts::Given(vec![2, 2])),
        partition: Some("balanced".into()),
        ..strategy("pp")
    };
    assert!(both.named(1).unwrap_err().to_string().contains("give one"));
}

#[test]
fn a_server_keeps_one_lane_per_stage_within_its_slots() {
    let pp = strategy("pp");
    let lanes = |s: Strategy| match s {
        Strategy::Pipeline { micro_batches, .. } => micro_batches,
        other => panic!("not a pipeline: {other}"),
    };
    assert_eq!(lanes(pp.serving(4, 8).unwrap()), 4);
    assert_eq!(lanes(pp.serving(4, 2).unwrap()), 2);
    let many = StrategyChoice {
        micro_batches: Some(6),
        ..strategy("pp")
    };
    let err = many.serving(2, 4).unwrap_err().to_string();
    assert!(
        err.contains("--micro-batches 6") && err.contains("--max-batch 4"),
        "{err}"
    );
    let gpipe = StrategyChoice {
        schedule: Some("gpipe".into()),
        ..strategy("pp")
    };
    assert!(gpipe
        .serving(2, 4)
        .unwrap_err()
        .to_string()
        .contains("gpipe"));
    assert!(matches!(
        strategy("tp").serving(2, 1).unwrap(),
        Strategy::Tensor { split: None }
    ));
}

#[test]
fn device_choices_count_what_they_select() {
    let listed = DeviceChoice {
        devices: Some("0,1,1".into()),
        ..DeviceChoice::default()
    };
    assert_eq!(listed.count(), 3);
    assert_eq!(listed.one_unless_named().count(), 3);
    assert_eq!(DeviceChoice::default().count(), 1);
    assert_eq!(
        DeviceChoice::default().one_unless_named().virtual_count,
        Some(1)
    );
    assert_eq!(parse_virtual("4"), Ok(4));
    assert!(parse_virtual("0").is_err() && parse_virtual(&(MAX_DEVICES + 1).to_string()).is_err());
    assert_eq!(parse_counts("3, 5"), Ok(Counts::Given(vec![3, 5])));
    assert_eq!(parse_counts("auto"), Ok(Counts::Auto));
    assert!(parse_counts("3,x").unwrap_err().contains("'x'"));
}

fn tiny(model: &ModelRef) -> ModelChoice<'_> {
    ModelChoice {
        model,
        dtype: "f32",
        weights: None,
        seed: 7,
        max_seq: None,
    }
}

fn compare_choice<'a>(
    model: &'a ModelRef,
    (profiles, engines): (&'a [String], &'a [String]),
    batches: &'a [usize],
) -> CompareChoice<'a> {
    CompareChoice {
        model: tiny(model),
        devices: None,
        virtual_count: Some(2),
        binding: Default::default(),
        gpu_memory: None,
        batches,
        micro_batches: &[1, 2],
        schedule: "in-flight",
        prompt_len: 5,
        gen: 3,
        reps: 1,
        serve: ServeChoice {
            requests: 4,
            rate: Rate::Burst,
            prompt_len: None,
            output_len: Some(Length::Fixed(2)),
            max_batch: 2,
        },
        profiles,
        engines,
        at_scale: false,
    }
}

#[test]
fn compare_resolves_its_names_and_refuses_bad_ones_by_option() {
    let model = ModelRef::Preset("tiny-llama".into());
    let profiles = ["pcie4-4gpu".to_string(), "dgx-h100".to_string()];
    let engines = ["wgpar".to_string(), "cuda-nccl".to_string()];
    let good = compare_choice(&model, (&profiles, &engines), &[1, 3]);
    let resolved = good.resolve().unwrap();
    assert_eq!(resolved.config.name, "tiny-llama");
    assert_eq!(resolved.profiles.len(), 2);
    assert_eq!(resolved.engines.len(), 2);
    let opts = good.options(resolved, wgpar::device::DType::F32).unwrap();
    assert_eq!((opts.batches.as_slice(), opts.seed), ([1, 3].as_slice(), 7));
    let serving = opts.serving.expect("the serving section");
    // The prompt length falls back to the sweep's; the output length is the one given.
    assert_eq!(
        (serving.prompt_len, serving.output_len),
        (Length::Fixed(5), Length::Fixed(2))
    );
    let bad_engine = ["wgpar".to_string(), "no-such-engine".to_string()];
    let cases = [
        (
            compare_choice(&model, (&profiles, &bad_engine), &[1]),
            "--engines",
        ),
        (
            compare_choice(&model, (&profiles, &engines), &[1, 0]),
            "--batches",
        ),
        (
            CompareChoice {
                schedule: "sideways",
                ..compare_choice(&model, (&profiles, &engines), &[1])
            },
            "--schedule",
        ),
    ];
    for (choice, option) in cases {
        let err = choice.resolve().expect_err(option).to_string();
        assert!(err.contains(option), "{option}: {err}");
    }
    let bad_profile = ["no-such-profile".to_string()];
    let err = compare_choice(&model, (&bad_profile, &engines), &[1]).resolve();
    assert!(err.unwrap_err().to_string().contains("no-such-profile"));
}

#[test]
fn compare_plans_its_devices_before_opening_them() {
    let model = ModelRef::Preset("tiny-llama".into());
    let (profiles, engines) = (["pcie4-4gpu".to_string()], ["wgpar".to_string()]);
    let plan = compare_choice(&model, (&profiles, &engines), &[1, 2])
        .plan()
        .unwrap();
    assert!(matches!(
        plan.selection,
        DeviceSelection::Virtual { count: 2, .. }
    ));
    assert_eq!(plan.options.micro_batches, [1, 2]);
    let too_small = CompareChoice {
        gpu_memory: Some("1K"),
        ..compare_choice(&model, (&profiles, &engines), &[1])
    };
    let err = too_small.plan().err().expect("over the cap").to_string();
    assert!(err.contains("--gpu-memory"), "{err}");
}

fn run_choice<'a>(model: &'a ModelRef, fault: Option<&'a str>) -> RunChoice<'a> {
    RunChoice {
        devices: DeviceChoice {
            virtual_count: Some(2),
            ..DeviceChoice::default()
        },
        model: tiny(model),
        strategy: StrategyChoice {
            strategy: "pp".into(),
            ..StrategyChoice::default()
        },
        gpu_memory: None,
        inject_fault: fault,
        pace: None,
        trace: None,
        logits_out: None,
        device_timestamps: "off",
    }
}

#[test]
fn timed_generation_runs_a_pipeline_as_one_device_does_and_arms_faults_past_the_warm_up() {
    let model = ModelRef::Preset("tiny-llama".into());
    let choice = run_choice(&model, None);
    let config = choice.model.config().unwrap();
    let run = TimedRun {
        batch: 2,
        prompt_len: 5,
        gen: 3,
        keep: KeepLogits::None,
    };
    let mut said = Vec::new();
    let done = (choice.timed_generation(&config, run, &mut |l| {
        said.push(l.to_string());
        Ok(())
    }))
    .unwrap();
    assert!(said[0].starts_with("model tiny-llama"), "{said:?}");
    assert!(said.iter().any(|l| l.starts_with("engine: ")), "{said:?}");
    assert!(done.decode_pipeline.is_some(), "a pipeline's bubble");
    assert_eq!(done.memory.lines().count(), 2, "{}", done.memory);
    assert!(done.weights.starts_with("weights: "), "{}", done.weights);
    // The same prompts greedily on one device, built without the plan.
    let adapters = Adapters::discover().unwrap();
    let gpus = choice.devices.open_first(&adapters, 1).unwrap();
    let weights = choice.model.weights(&config).unwrap();
    let dtype = choice.model.dtype(&gpus).unwrap();
    let comm = CommConfig::default();
    let mut single =
        build_engine(&Strategy::Single, &gpus, &weights, dtype, &comm, (2, 5)).unwrap();
    let reference = generate(single.as_mut(), &run.prompts(config.vocab), run.gen).unwrap();
    let tokens = &done.timed.generation.tokens;
    assert_eq!(tokens.len(), 2);
    assert!(tokens.iter().all(|t| t.len() == 3), "{tokens:?}");
    assert_eq!(tokens, &reference.tokens);

    let faulty = run_choice(&model, Some("stage=1,kind=error,at=step:1"));
    said.clear();
    let result = faulty.timed_generation(&config, run, &mut |l| {
        said.push(l.to_string());
        Ok(())
    });
    let err = result.err().expect("the injected fault").to_string();
    let armed = said.iter().find(|l| l.starts_with("injecting")).cloned();
    // One job of stage 1 in the timed run, shifted past the warm-up's.
    let armed = armed.unwrap_or_else(|| panic!("{said:?}"));
    assert!(armed.contains("stage 1 after 1 of its jobs"), "{armed}");
    assert!(err.contains("stage 1"), "{err}");
}
