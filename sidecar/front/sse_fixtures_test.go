package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// The recorded streams of tests/fixtures/sse, which sse.py's tests read too: both
// counters must count the same tokens and text events, however reads cut them.
type sseFixture struct {
	Events        []string `json:"events"`
	Tokens        int      `json:"tokens"`
	ContentEvents int      `json:"content_events"`
	UsageTokens   *int     `json:"usage_tokens"`
}

func TestScannerCountsTheRecordedStreams(t *testing.T) {
	paths, err := filepath.Glob(filepath.Join("..", "..", "tests", "fixtures", "sse", "*.json"))
	if err != nil || len(paths) < 3 {
		t.Fatalf("fixtures: %v (%d found)", err, len(paths))
	}
	for _, path := range paths {
		raw, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var fx sseFixture
		if err := json.Unmarshal(raw, &fx); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		var stream []byte
		for _, ev := range fx.Events {
			stream = append(stream, "data: "+ev+"\n\n"...)
		}
		for _, step := range []int{1, 7, len(stream)} {
			s := newScanner()
			for i := 0; i < len(stream); i += step {
				s.feed(stream[i:min(i+step, len(stream))])
			}
			if s.counted != fx.Tokens || s.contents != fx.ContentEvents {
				t.Errorf("%s (reads of %d bytes): %d token events, %d with text; want %d and %d",
					filepath.Base(path), step, s.counted, s.contents, fx.Tokens, fx.ContentEvents)
			}
			want := fx.Tokens
			if fx.UsageTokens != nil {
				want = *fx.UsageTokens
			}
			if s.tokens() != want {
				t.Errorf("%s: tokens() %d, want %d", filepath.Base(path), s.tokens(), want)
			}
		}
	}
}
