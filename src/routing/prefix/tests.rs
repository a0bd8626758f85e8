//! The prefix table's counting: strided counts keep their expected value, and the
//! slot of a chunk all traffic shares is written in few of the requests through it.

use super::*;

/// One 2,088-byte message (four whole chunks and a short one), the same every request.
fn walk(table: &PrefixTable, text: &[u8]) -> Depth {
    let segments = [Segment {
        tag: "system",
        body: text,
    }];
    table.walk(
        &mut Chunks::new(&segments, 7, 64 * 1024, false),
        Mode::Route,
    )
}

fn first_slot(table: &PrefixTable, text: &[u8]) -> u64 {
    let segments = [Segment {
        tag: "system",
        body: text,
    }];
    let hash = Chunks::new(&segments, 7, 64 * 1024, false)
        .next()
        .unwrap()
        .hash;
    table.slots[slot_of(hash)].load(Ordering::Relaxed)
}

#[test]
fn strided_increments_add_up_to_the_count() {
    // Below the stride's start every request counts one.
    assert!((0..1000).all(|seq| increment(STRIDE_FROM - 1, seq, 42) == 1));
    for (count, stride) in [(STRIDE_FROM * 3, 4), (8000, MAX_STRIDE)] {
        for hash in [1u64, 0xDEAD_BEEF, u64::MAX] {
            let added: u32 = (0..64_000).map(|seq| increment(count, seq, hash)).sum();
            let off = (f64::from(added) / 64_000.0 - 1.0).abs();
            assert!(
                off < 0.06,
                "count {count}, hash {hash:x}: {added} over 64,000"
            );
            assert!((0..64_000).all(|seq| [0, stride].contains(&increment(count, seq, hash))));
        }
    }
}

#[test]
fn a_chunk_all_traffic_shares_counts_every_request_and_is_written_seldom() {
    let table = PrefixTable::default();
    let text = "You are a helpful assistant. ".repeat(72);
    let mut writes = 0;
    let mut before = first_slot(&table, text.as_bytes());
    for _ in 0..4000 {
        let depth = walk(&table, text.as_bytes());
        assert_eq!(
            depth.hot_chunks > 0,
            table.total.load(Ordering::Relaxed) >= HOT_MIN
        );
        let after = first_slot(&table, text.as_bytes());
        writes += usize::from(after != before);
        before = after;
    }
    let count = Slot::unpack(before).count;
    // The expected count is exact; strides of up to 16 leave it within a few percent.
    assert!(
        (3700..=4300).contains(&count),
        "count {count} after 4,000 requests"
    );
    // Written on each of the first STRIDE_FROM requests, then once a stride at most.
    assert!(writes < 1200, "written {writes} times in 4,000 requests");
}

proptest::proptest! {
    /// The chunk hash is xxh3's own seeded hash, at every length and seed (the chain
    /// hashes, and so every prefix group's place on the ring, stay as they were).
    #[test]
    fn seeded_xxh3_is_xxh3_with_the_seed(
        piece in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1200),
        seed in proptest::prelude::any::<u64>(),
    ) {
        proptest::prop_assert_eq!(
            seeded_xxh3(&piece, seed),
            xxh3_64_with_seed(&piece, seed)
        );
    }
}

#[test]
fn seeded_xxh3_is_xxh3_with_the_seed_for_whole_chunks() {
    let chunk: Vec<u8> = (0..CHUNK).map(|i| (i * 31 % 251) as u8).collect();
    for seed in [0, 1, 0x7072_6566_6978_6c62, u64::MAX] {
        for len in [240, 241, CHUNK] {
            assert_eq!(
                seeded_xxh3(&chunk[..len], seed),
                xxh3_64_with_seed(&chunk[..len], seed),
                "{len} bytes, seed {seed:#x}"
            );
        }
    }
}
