//! Structured output: whatever the model (the tiny llama's random weights, which would write
//! byte noise on their own), every output of a constrained request matches its JSON schema,
//! regex, choice list or grammar, greedy and sampled, with `n > 1` and beside unconstrained
//! requests in the same batch, which it does not change. Bad constraints are refused before
//! anything is queued. One test runs the default model's real tokenizer.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{config, default_engine, tiny_engine};
use kiln_engine::{
    Constraint, ConstraintCompiler, ConstraintError, ConstraintKind, EngineError, EngineHandle,
    Field, FinishReason, Output, Request, SamplingParams,
};
use kiln_tensor::Device;
use serde_json::{Value, json};

/// The tiny llama's EOS (a byte the grammars below never need).
const EOS: u32 = 255;

fn engine() -> EngineHandle {
    tiny_engine(&Device::reference(), EOS, config(256, 8, 64, 8))
}

fn run(e: &EngineHandle, r: Request) -> Output {
    e.submit(r).unwrap().blocking_collect().unwrap()
}

fn prompt() -> Request {
    Request::tokens(vec![10, 20, 30, 40, 50, 60, 70])
}

/// Greedy, and sampled at temperature 1 under a few seeds.
fn settings() -> Vec<(SamplingParams, u64)> {
    let mut out = vec![(SamplingParams::greedy(), 0)];
    for seed in [1, 2, 3, 4] {
        out.push((SamplingParams::default(), seed));
    }
    out
}

/// Runs `c` under every setting; returns each output's text after checking it ended because
/// the constraint was complete (or the model ended it with EOS where the constraint allows).
fn outputs(e: &EngineHandle, c: &Constraint, max_new: usize) -> Vec<String> {
    let mut texts = Vec::new();
    for (params, seed) in settings() {
        let r = prompt()
            .max_new_tokens(max_new)
            .sampling(params.clone(), seed)
            .constrain(c.clone());
        let out = run(e, r);
        let o = &out.outputs[0];
        assert!(
            matches!(
                o.finish,
                Some(FinishReason::ConstraintComplete | FinishReason::EosToken)
            ),
            "{c:?} {params:?} seed {seed}: ended {:?} after {:?}",
            o.finish,
            o.text
        );
        texts.push(o.text.clone());
    }
    texts
}

/// A schema and what a value valid under it satisfies (checked by hand: the Python client
/// test checks the same outputs with `jsonschema` itself).
/// What a valid value satisfies.
type Check = fn(&Value) -> bool;

fn schemas() -> Vec<(Value, Check)> {
    vec![
        (
            json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120}
                },
                "required": ["name", "age"],
                "additionalProperties": false
            }),
            |v| {
                let o = v.as_object().unwrap();
                o.len() == 2
                    && o["name"].as_str().is_some_and(|s| s.chars().count() <= 6)
                    && o["age"].as_i64().is_some_and(|a| (0..=120).contains(&a))
            },
        ),
        (
            json!({
                "type": "object",
                "properties": {
                    "tags": {
                        "type": "array",
                        "items": {"enum": ["red", "green", "blue"]},
                        "minItems": 1,
                        "maxItems": 3
                    },
                    "ok": {"type": "boolean"},
                    "note": {"type": ["string", "null"], "maxLength": 4}
                },
                "required": ["tags", "ok", "note"],
                "additionalProperties": false
            }),
            |v| {
                let tags = v["tags"].as_array().unwrap();
                (1..=3).contains(&tags.len())
                    && tags
                        .iter()
                        .all(|t| ["red", "green", "blue"].contains(&t.as_str().unwrap()))
                    && v["ok"].is_boolean()
                    && (v["note"].is_null()
                        || v["note"].as_str().is_some_and(|s| s.chars().count() <= 4))
            },
        ),
        (
            json!({
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "point": {
                        "type": "object",
                        "properties": {
                            "x": {"type": "integer", "minimum": -9, "maximum": 9},
                            "y": {"type": "integer", "minimum": -9, "maximum": 9}
                        },
                        "required": ["x", "y"],
                        "additionalProperties": false
                    }
                },
                "required": ["id", "point"],
                "additionalProperties": false
            }),
            |v| {
                let id = v["id"].as_str().unwrap();
                let b = id.as_bytes();
                // JSON Schema's integers are numbers with no fraction: `-0` is one (serde_json
                // reads it as a float).
                let in_box = |c: &Value| {
                    c.as_f64()
                        .is_some_and(|x| x.fract() == 0.0 && (-9.0..=9.0).contains(&x))
                };
                b.len() == 6
                    && b[..2].iter().all(u8::is_ascii_uppercase)
                    && b[2] == b'-'
                    && b[3..].iter().all(u8::is_ascii_digit)
                    && in_box(&v["point"]["x"])
                    && in_box(&v["point"]["y"])
            },
        ),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 24,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Random seeds, temperatures and top-p over every schema: the output validates.
    #[test]
    fn sampled_outputs_validate_for_any_seed(
        which in 0usize..3,
        seed in proptest::prelude::any::<u64>(),
        temperature in 0.2f32..2.0,
        top_p in 0.5f32..=1.0,
    ) {
        static ENGINE: std::sync::OnceLock<EngineHandle> = std::sync::OnceLock::new();
        let e = ENGINE.get_or_init(engine);
        let (schema, valid) = schemas().swap_remove(which);
        let params = SamplingParams { temperature, top_p, ..SamplingParams::default() };
        let r = prompt()
            .max_new_tokens(160)
            .sampling(params, seed)
            .constrain(Constraint::JsonSchema(schema.clone()));
        let out = run(e, r);
        let o = &out.outputs[0];
        proptest::prop_assert!(
            matches!(o.finish, Some(FinishReason::ConstraintComplete | FinishReason::EosToken)),
            "ended {:?} after {:?}", o.finish, o.text
        );
        let v: Value = serde_json::from_str(&o.text)
            .map_err(|err| proptest::test_runner::TestCaseError::fail(format!("{:?}: {err}", o.text)))?;
        proptest::prop_assert!(valid(&v), "{schema}: {} does not match", o.text);
    }
}

#[test]
fn json_schema_outputs_validate_greedy_and_sampled() {
    let e = engine();
    for (schema, valid) in schemas() {
        for text in outputs(&e, &Constraint::JsonSchema(schema.clone()), 160) {
            let v: Value = serde_json::from_str(&text)
                .unwrap_or_else(|err| panic!("{schema}: {text:?} is not JSON: {err}"));
            assert!(valid(&v), "{schema}: {text} does not match");
            // Compact, as `json.dumps` writes it: no whitespace but after `,` and `:`.
            for bad in ["\n", "{ ", " }", "[ ", " ]", " ,", " :"] {
                assert!(!text.contains(bad), "{text:?} has {bad:?}");
            }
        }
    }
}

#[test]
fn json_object_regex_choice_and_grammar_outputs_match() {
    let e = engine();
    for text in outputs(&e, &Constraint::JsonObject, 200) {
        // A random model in an open object may run out of tokens; what it finished must parse.
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v.is_object(), "{text}");
    }
    let rx = regex::Regex::new("^[a-c]{2,4}-[0-9]{3}$").unwrap();
    for text in outputs(&e, &Constraint::Regex("[a-c]{2,4}-[0-9]{3}".into()), 32) {
        assert!(rx.is_match(&text), "{text:?}");
    }
    let choices = vec![
        "yes".to_owned(),
        "no".to_owned(),
        "n/a \"quoted\"".to_owned(),
    ];
    for text in outputs(&e, &Constraint::Choice(choices.clone()), 32) {
        assert!(choices.contains(&text), "{text:?}");
    }
    let grammar =
        "start: pair (\";\" pair)?\npair: KEY \"=\" VALUE\nKEY: /[a-z]{1,3}/\nVALUE: /[0-9]{1,2}/";
    let pair = "[a-z]{1,3}=[0-9]{1,2}";
    let rx = regex::Regex::new(&format!("^{pair}(;{pair})?$")).unwrap();
    for text in outputs(&e, &Constraint::Grammar(grammar.into()), 32) {
        assert!(rx.is_match(&text), "{text:?}");
    }
}

#[test]
fn every_output_of_n_matches_and_unconstrained_neighbours_are_unchanged() {
    let e = engine();
    let choices = vec!["alpha".to_owned(), "beta".to_owned(), "gamma".to_owned()];
    let mut r = prompt()
        .max_new_tokens(16)
        .sampling(SamplingParams::default(), 7)
        .constrain(Constraint::Choice(choices.clone()));
    r.n = 4;
    let plain = || {
        Request::tokens(vec![5, 6, 7, 8])
            .max_new_tokens(24)
            .sampling(SamplingParams::default(), 11)
    };
    let alone = run(&e, plain());
    // Submitted together, so they share steps.
    let a = e.submit(r).unwrap();
    let b = e.submit(plain()).unwrap();
    let constrained = a.blocking_collect().unwrap();
    let beside = b.blocking_collect().unwrap();
    assert_eq!(constrained.outputs.len(), 4);
    for o in &constrained.outputs {
        assert!(choices.contains(&o.text), "{:?}", o.text);
        assert_eq!(o.finish, Some(FinishReason::ConstraintComplete));
    }
    assert_eq!(beside.outputs[0].token_ids, alone.outputs[0].token_ids);
}

#[test]
fn the_grammar_wins_over_min_new_tokens() {
    let e = engine();
    let mut r = prompt()
        .max_new_tokens(16)
        .constrain(Constraint::Choice(vec!["ok".into()]));
    r.stopping.min_new_tokens = 8;
    let out = run(&e, r);
    assert_eq!(out.outputs[0].text, "ok");
    assert_eq!(
        out.outputs[0].finish,
        Some(FinishReason::ConstraintComplete)
    );
}

#[test]
fn bad_constraints_are_refused_before_queueing_naming_the_field() {
    let e = engine();
    let cases = [
        (
            Constraint::JsonSchema(
                json!({"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
            ),
            Field::Constraint(ConstraintKind::JsonSchema),
        ),
        (
            Constraint::Regex("[a-".into()),
            Field::Constraint(ConstraintKind::Regex),
        ),
        (
            Constraint::Regex(String::new()),
            Field::Constraint(ConstraintKind::Regex),
        ),
        (
            Constraint::Choice(Vec::new()),
            Field::Constraint(ConstraintKind::Choice),
        ),
        (
            Constraint::Choice(vec!["a".into(), String::new()]),
            Field::Constraint(ConstraintKind::Choice),
        ),
        (
            Constraint::Grammar("start: undefined_rule".into()),
            Field::Constraint(ConstraintKind::Grammar),
        ),
        (
            Constraint::Grammar("start: (".into()),
            Field::Constraint(ConstraintKind::Grammar),
        ),
    ];
    for (c, field) in cases {
        match e.submit(prompt().max_new_tokens(4).constrain(c.clone())) {
            Err(EngineError::InvalidArgument {
                field: f, reason, ..
            }) => {
                assert_eq!(f, field, "{c:?}: {reason}");
                assert!(!reason.is_empty());
            }
            other => panic!("{c:?} was not refused: {other:?}"),
        }
    }
    let s = e.stats_blocking().unwrap();
    assert_eq!((s.requests, s.waiting, s.running), (0, 0, 0));
    s.invariants.unwrap();
    // A model without an EOS cannot end a constrained output: a typed reason, not a string.
    assert!(matches!(
        ConstraintCompiler::new(e.tokenizer(), &[]),
        Err(ConstraintError::NoEos)
    ));
    assert!(ConstraintCompiler::new(e.tokenizer(), &[EOS]).is_ok());
}

/// The default model's real byte-level BPE vocabulary (tokens that span several JSON
/// characters, `Ġ`-spaces) under a schema, greedy: a real answer that validates.
#[test]
fn default_model_writes_valid_json_under_a_schema() {
    let e = default_engine(&Device::reference(), config(128, 16, 256, 4));
    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": false
    });
    let r = Request::text("The largest city in France, as JSON: ")
        .max_new_tokens(64)
        .constrain(Constraint::JsonSchema(schema));
    let out = run(&e, r);
    let o = &out.outputs[0];
    assert_eq!(
        o.finish,
        Some(FinishReason::ConstraintComplete),
        "{:?}",
        o.text
    );
    let v: Value = serde_json::from_str(&o.text).unwrap();
    assert!(v["city"].as_str().is_some_and(|s| s.chars().count() <= 20));
    assert!(v["country"].as_str().is_some());
    assert!(
        v["population_millions"]
            .as_i64()
            .is_some_and(|p| (0..=100).contains(&p))
    );
}

/// A constraint after a fixed text (what closes a reasoning model's open think block): the
/// output is the text, then what the constraint admits, for every kind of constraint (a
/// grammar's own start rule follows the text).
#[test]
fn a_constraint_after_a_text_holds_after_it() {
    let e = engine();
    let close = "</think>\n\n";
    let cases = [
        Constraint::JsonObject,
        Constraint::JsonSchema(json!({"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a"], "additionalProperties": false})),
        Constraint::Regex("ab/c{3}".into()),
        Constraint::Choice(vec!["yes".into(), "no".into()]),
        Constraint::Grammar("start: word \"!\"\nword: \"hi\" | \"ho\"".into()),
    ];
    for c in cases {
        let r = prompt()
            .max_new_tokens(40)
            .constrain(c.clone().after(close));
        let out = run(&e, r);
        let text = &out.outputs[0].text;
        let rest = text
            .strip_prefix(close)
            .unwrap_or_else(|| panic!("{c:?}: {text:?} does not start with the closing text"));
        if c == Constraint::JsonObject {
            // Free keys: a random model need not close the object in 40 tokens.
            assert!(rest.starts_with('{'), "{rest:?}");
            continue;
        }
        assert_eq!(
            out.outputs[0].finish,
            Some(FinishReason::ConstraintComplete),
            "{c:?}: {text:?}"
        );
        match &c {
            Constraint::JsonObject | Constraint::JsonSchema(_) => {
                let v: Value = serde_json::from_str(rest).unwrap();
                assert!(v.is_object(), "{rest}");
            }
            Constraint::Regex(_) => assert_eq!(rest, "ab/ccc"),
            Constraint::Choice(_) => assert!(rest == "yes" || rest == "no", "{rest:?}"),
            Constraint::Grammar(_) => assert!(rest == "hi!" || rest == "ho!", "{rest:?}"),
            Constraint::After { .. } => unreachable!(),
        }
    }
}
