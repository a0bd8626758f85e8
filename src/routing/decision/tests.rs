//! The one entry point: a placement's pool chain, and a ticket from admission to its
//! end (the trial it owes a breaker, the home it settles, what it teaches).

use std::time::{Duration, Instant};

use super::*;
use crate::config::Config;
use crate::routing::breaker::{Admission, BreakerState};
use crate::routing::table::Registry;

fn table(text: &str) -> Table {
    Table::build(Config::parse(text, "t.toml").unwrap(), &Registry::default())
}

const ONE: &str = r#"
[[pools]]
name = "p"
models = ["m"]
nodes = [{ id = "a", url = "http://h:1" }, { id = "b", url = "http://h:2" }]
"#;

fn chat(user: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": user}],
    }))
    .unwrap()
}

fn chosen(w: Walk) -> Choice {
    match w {
        Walk::Chosen(c) => c,
        other => panic!("expected a node, got {other:?}"),
    }
}

#[test]
fn a_ticket_dropped_before_it_settles_gives_its_trial_back() {
    let t = table(ONE);
    let now = Instant::now();
    let p = t
        .place("/v1/chat/completions", None, &chat("hi"), Mode::Route)
        .unwrap();
    let b = &p.pool().balancer;
    // Open both nodes, then let `open_for` pass: the next asker is a node's trial.
    for n in b.nodes() {
        for _ in 0..2 {
            n.state().record(Outcome::Failure, false, b.settings(), now);
        }
        assert_eq!(n.state().breaker.state(), BreakerState::Open);
    }
    let later = now + Duration::from_secs(31);
    let c = chosen(p.choose(&[], later));
    assert!(c.trial);
    let index = c.index;
    let ticket = p.ticket(c, later);
    // Its node's breaker refuses a second trial while this one is out.
    let breaker = &b.node(index).state().breaker;
    assert_eq!(breaker.peek(p.hash, b.settings(), later), Admission::Refuse);
    // The client leaves before the answer commits: the trial is given back.
    drop(ticket);
    assert_eq!(breaker.peek(p.hash, b.settings(), later), Admission::Trial);
    assert_eq!(b.node(index).state().in_flight(), 0);
}

#[test]
fn a_settled_ticket_remembers_the_home_and_its_finish_teaches_the_pool() {
    let t = table(ONE);
    let now = Instant::now();
    let opening = chat("a conversation that opens here");
    let p = t
        .place("/v1/chat/completions", None, &opening, Mode::Route)
        .unwrap();
    assert_eq!(p.home, None);
    let pool = p.pool().clone();
    let b = &pool.balancer;
    let mut ticket = p.ticket(chosen(p.choose(&[], now)), now);
    let node = ticket.index();
    ticket.settle(now);
    let home = b.home_of(p.hash).unwrap();
    assert_eq!(home.index, node, "settled: at home there");
    assert_eq!(
        home.tokens,
        p.facts.tokens.prompt / 64 * 64,
        "what it sent there"
    );
    assert_eq!(
        b.node(node).state().in_flight(),
        1,
        "the slot is held to the end"
    );
    let usage = Usage {
        prompt_tokens: 2000,
        cached_tokens: 0,
    };
    ticket.finish(
        usage,
        Some(Duration::from_millis(400)),
        now + Duration::from_secs(2),
    );
    assert_eq!(b.node(node).state().in_flight(), 0);
    assert_eq!(
        b.node(node).state().slot_time.get(),
        Some(Duration::from_secs(2)),
        "held from its slot to its end"
    );
    // Its next turn goes home, and an explanation says so without counting anything.
    let x = t
        .place("/v1/chat/completions", None, &opening, Mode::Explain)
        .unwrap();
    assert_eq!(x.home.map(|h| h.index), Some(node));
    assert_eq!(x.target.first, Some(node));
}

#[test]
fn a_reasoning_request_is_placed_in_the_first_pool_of_its_chain_that_thinks() {
    let t = table(
        r#"
[[pools]]
name = "fast"
models = ["m"]
fallbacks = ["deep", "deeper"]
supports_thinking = false
nodes = [{ id = "a", url = "http://h:1" }]
[[pools]]
name = "deep"
models = ["d"]
nodes = [{ id = "b", url = "http://h:2" }]
[[pools]]
name = "deeper"
models = ["dd"]
nodes = [{ id = "c", url = "http://h:3" }]
"#,
    );
    let body = |thinking: bool| {
        serde_json::to_vec(&serde_json::json!({
            "model": "m",
            "messages": [{"role": "user", "content": "why?"}],
            "chat_template_kwargs": {"enable_thinking": thinking},
        }))
        .unwrap()
    };
    let plain = t
        .place("/v1/chat/completions", None, &body(false), Mode::Explain)
        .unwrap();
    assert_eq!(plain.pool().config.name, "fast");
    assert!(!plain.is_fallback());
    let deep = t
        .place("/v1/chat/completions", None, &body(true), Mode::Explain)
        .unwrap();
    assert_eq!(deep.pool().config.name, "deep");
    assert!(deep.is_fallback());
    assert_eq!(deep.own_pool(), 0);
    let deeper = deep.fallback(&t).unwrap();
    assert_eq!(deeper.pool().config.name, "deeper");
    assert!(deeper.fallback(&t).is_none(), "the chain ends");
}

#[test]
fn a_reasoning_request_no_pool_can_serve_is_an_error() {
    let t = table(&ONE.replace(
        "models = [\"m\"]",
        "models = [\"m\"]\nsupports_thinking = false",
    ));
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "m", "messages": [{"role": "user", "content": "why?"}], "reasoning_effort": "high",
    }))
    .unwrap();
    let err = t
        .place("/v1/chat/completions", None, &body, Mode::Route)
        .unwrap_err();
    assert_eq!(
        err,
        PlaceError::Pool(PoolError::NoThinking { pool: "p".into() })
    );
}

/// An untemplated completions prompt: a 2,048-byte block every prompt shares, then a
/// sequence's own text (`own` bytes of it), as production prompt strings come.
fn prompt(sequence: usize, own: usize) -> Vec<u8> {
    let shared = "Platform preamble. ".repeat(108)[..2048].to_string();
    let text: String = format!("sequence {sequence}: ")
        .chars()
        .chain("words of its own ".chars().cycle())
        .take(own)
        .collect();
    serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": format!("{shared}{text}")}))
        .unwrap()
}

#[test]
fn a_prompt_string_nobody_sent_before_is_new_and_keeps_the_home_it_got() {
    // The lead of the held-out trace's loss: a long prompt string was taken for a
    // returning conversation ("later", expecting most of it cached), so finding only
    // the shared block moved its home away from the node that had just cached it.
    let t = table(ONE);
    let now = Instant::now();
    for s in 0..40 {
        let p = t
            .place("/v1/completions", None, &prompt(s, 3000), Mode::Route)
            .unwrap();
        drop(p.ticket(chosen(p.choose(&[], now)), now));
    }
    let body = prompt(99, 40_000);
    let x = t
        .place("/v1/completions", None, &body, Mode::Explain)
        .unwrap();
    assert!(
        x.facts.prefix.is_some_and(|p| p.learned),
        "the shared block is learned"
    );
    assert_eq!(x.facts.turn, crate::routing::facts::Turn::Unknown);
    assert_eq!(
        (x.home, x.stakes.expect),
        (None, 0.0),
        "nothing is expected cached"
    );
    let p = t
        .place("/v1/completions", None, &body, Mode::Route)
        .unwrap();
    let mut ticket = p.ticket(chosen(p.choose(&[], now)), now);
    let node = ticket.index();
    ticket.settle(now);
    let pool = p.pool().clone();
    let b = &pool.balancer;
    assert_eq!(
        b.home_of(p.hash).map(|h| h.index),
        Some(node),
        "at home where admitted"
    );
    // It found only the shared block (512 of 10,512 tokens): it was new, not misplaced.
    let usage = Usage {
        prompt_tokens: 10_512,
        cached_tokens: 512,
    };
    ticket.finish(usage, Some(Duration::from_millis(900)), now);
    assert_eq!(
        b.home_of(p.hash).map(|h| h.index),
        Some(node),
        "the home stays"
    );
    // Its continuation goes there, expecting what it sent there cached.
    let next = t
        .place("/v1/completions", None, &prompt(99, 42_000), Mode::Explain)
        .unwrap();
    assert_eq!(next.target.first, Some(node));
    assert!(next.stakes.history >= 10_000, "{:?}", next.stakes);
    assert!(next.stakes.expect > 0.9, "{:?}", next.stakes);
}

const TWO_POOLS: &str = r#"
[[pools]]
name = "p"
models = ["m"]
nodes = [{ id = "a", url = "http://h:1" }, { id = "b", url = "http://h:2" }, { id = "c", url = "http://h:3" }]
[[pools]]
name = "q"
models = ["n"]
nodes = [{ id = "d", url = "http://h:4" }, { id = "e", url = "http://h:5" }]
"#;

fn follows(model: &str, id: &str, input: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": model, "input": input, "previous_response_id": id,
    }))
    .unwrap()
}

#[test]
fn a_stored_response_is_placed_on_its_engine_alone_or_searched_for() {
    let t = table(TWO_POOLS);
    let p = &t.pools[0].balancer;
    p.hold(stored::id_hash("resp_1"), 2);
    let now = Instant::now();
    // Known: its walk starts at its engine, and every other node is ruled out, so
    // neither a spill nor a wait for another home can take it elsewhere.
    for input in ["one", "two", "three", "four"] {
        let placed = t
            .place(
                "/v1/responses",
                None,
                &follows("m", "resp_1", input),
                Mode::Route,
            )
            .unwrap();
        assert_eq!(placed.holder(), Holder::Only(2));
        assert_eq!(placed.target.first, Some(2));
        assert_eq!(placed.unserved(), &[0, 1]);
        assert_eq!(placed.holding_node().unwrap().id(), "c");
        assert_eq!(chosen(placed.choose(placed.unserved(), now)).index, 2);
        // No other pool holds it.
        assert!(placed.fallback(&t).is_none());
    }
    // Unknown: asked for everywhere.
    let placed = t
        .place(
            "/v1/responses",
            None,
            &follows("m", "resp_2", "x"),
            Mode::Explain,
        )
        .unwrap();
    assert_eq!(placed.holder(), Holder::Search);
    assert!(placed.unserved().is_empty());
    // Its own endpoints name no model: the pool that knows it, else each in turn.
    let q = &t.pools[1].balancer;
    q.hold(stored::id_hash("resp_q"), 1);
    let get = t
        .place("/v1/responses/resp_q", None, b"", Mode::Route)
        .unwrap();
    assert_eq!(get.api, Api::StoredResponse);
    assert_eq!(get.pool().config.name, "q");
    assert_eq!(get.holder(), Holder::Only(1));
    let cancel = t
        .place("/v1/responses/resp_x/cancel", None, b"", Mode::Route)
        .unwrap();
    assert_eq!(cancel.facts.follows.as_deref(), Some("resp_x"));
    assert_eq!(cancel.holder(), Holder::Search);
    assert_eq!(cancel.pool().config.name, "p");
    let next = cancel.fallback(&t).unwrap();
    assert_eq!(next.pool().config.name, "q");
    assert_eq!(next.holder(), Holder::Search);
    assert!(next.fallback(&t).is_none());
    // Deleted, it is held nowhere.
    q.forget(stored::id_hash("resp_q"));
    assert_eq!(q.holder_of(stored::id_hash("resp_q")), None);
}
