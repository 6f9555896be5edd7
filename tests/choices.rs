//! The library's plain choices, built the way an example or a test builds them without the
//! CLI: a strategy's options refused by name where they do not apply, a server's lanes
//! against its KV slots, and the device counts a choice selects.

use wgpar::device::{parse_virtual, DeviceChoice, MAX_DEVICES};
use wgpar::parallel::choice::{parse_counts, Counts, StrategyChoice};
use wgpar::parallel::Strategy;

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
