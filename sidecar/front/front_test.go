package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"math"
	"net"
	"testing"
	"time"
)

const completionEvent = `data: {"id":"c","choices":[{"index":0,"text":" word","finish_reason":null,"stop_reason":null}],"usage":null}`

func TestScannerCountsTokenEventsAcrossSplitReads(t *testing.T) {
	stream := completionEvent + "\n\n" + completionEvent + "\n\n" +
		`data: {"id":"c","choices":[{"index":0,"text":"","finish_reason":"length","stop_reason":null}],"usage":null}` + "\n\n" +
		"data: [DONE]\n\n"
	for cut := 1; cut < len(stream); cut++ {
		s := newScanner()
		a, _ := s.feed([]byte(stream[:cut]))
		b, _ := s.feed([]byte(stream[cut:]))
		found := a + b
		// The last event's empty text is a token too (vLLM holds back a partial character).
		if found != 3 || s.tokens() != 3 {
			t.Fatalf("cut at %d: found %d events, tokens %d; want 3", cut, found, s.tokens())
		}
	}
}

func TestScannerTakesUsageAsExact(t *testing.T) {
	s := newScanner()
	s.feed([]byte(completionEvent + "\n\n"))
	s.feed([]byte(`data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}` + "\n\n"))
	if s.counted != 1 || s.tokens() != 7 {
		t.Fatalf("counted %d tokens %d; want 1 and the usage's 7", s.counted, s.tokens())
	}
}

func TestScannerSkipsTheChatRoleChunk(t *testing.T) {
	s := newScanner()
	role := `data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`
	text := `data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}`
	if got, _ := s.feed([]byte(role + "\n\n" + text + "\n\n")); got != 1 {
		t.Fatalf("counted %d token events; want 1", got)
	}
}

func TestWithPriorityKeepsTheClientsBytes(t *testing.T) {
	body := []byte(" {\"model\":\"m\",\"prompt\":\"caf\u00e9 {x}\"}")
	got := withPriority(body, -3)
	want := `{"priority":-3,"model":"m","prompt":"café {x}"}`
	if string(got) != want {
		t.Fatalf("got %s, want %s", got, want)
	}
	var doc map[string]any
	if err := json.Unmarshal(got, &doc); err != nil || doc["priority"].(float64) != -3 {
		t.Fatalf("not JSON with the priority: %v %v", err, doc)
	}
}

func TestUsageTokensOfAWholeAnswer(t *testing.T) {
	if n := usageTokens([]byte(`{"choices":[],"usage":{"completion_tokens":5}}`)); n != 5 {
		t.Fatalf("got %d, want 5", n)
	}
	if n := usageTokens([]byte(`not json`)); n != 0 {
		t.Fatalf("got %d, want 0", n)
	}
}

// The frames over a real Unix socket pair: an arrival goes out, a grant comes
// back to the waiting request, a reply for a forgotten request is dropped.
func TestControlFramesBothWays(t *testing.T) {
	path := t.TempDir() + "/control.sock"
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctl, err := dialControl(path)
	if err != nil {
		t.Fatal(err)
	}
	peer, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	go ctl.run()

	wait := ctl.arrive(7, routeChat, []byte(`{"a":1}`))
	head := make([]byte, headerLen)
	peer.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := readFull(peer, head); err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint32(head[5:9])
	payload := make([]byte, n)
	if _, err := readFull(peer, payload); err != nil {
		t.Fatal(err)
	}
	if head[0] != kindArrival || binary.LittleEndian.Uint32(head[1:5]) != 7 || payload[0] != routeChat ||
		!bytes.Equal(payload[1:], []byte(`{"a":1}`)) {
		t.Fatalf("arrival frame %q %q", head, payload)
	}

	ctl.arrive(8, routeCompletions, []byte(`{}`))
	ctl.forget(8)
	for _, f := range [][]byte{frame(kindGrant, 8, []byte("1")), frame(kindGrant, 7, []byte("-2"))} {
		if _, err := peer.Write(f); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case r := <-wait:
		if r.kind != kindGrant || string(r.payload) != "-2" {
			t.Fatalf("reply %c %q", r.kind, r.payload)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no grant")
	}

	ctl.end(7, outcomeOK, 12, 0.5, 0.001, -1)
	// Skip the second arrival's frame, then read the end frame.
	for {
		if _, err := readFull(peer, head); err != nil {
			t.Fatal(err)
		}
		payload = make([]byte, binary.LittleEndian.Uint32(head[5:9]))
		if _, err := readFull(peer, payload); err != nil {
			t.Fatal(err)
		}
		if head[0] == kindEnd {
			break
		}
	}
	if payload[0] != outcomeOK || binary.LittleEndian.Uint32(payload[1:5]) != 12 ||
		math.Float64frombits(binary.LittleEndian.Uint64(payload[5:13])) != 0.5 ||
		math.Float64frombits(binary.LittleEndian.Uint64(payload[21:29])) != -1 {
		t.Fatalf("end frame %v", payload)
	}
}

func frame(kind byte, id uint32, payload []byte) []byte {
	f := make([]byte, headerLen+len(payload))
	putHeader(f, kind, id, len(payload))
	copy(f[headerLen:], payload)
	return f
}

func readFull(c net.Conn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := c.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

func allowanceFrame(seen, count, blocks uint32, ratio float64, blockSize uint32, prio int32) []byte {
	p := make([]byte, allowanceLen)
	binary.LittleEndian.PutUint32(p[0:], seen)
	binary.LittleEndian.PutUint32(p[4:], count)
	binary.LittleEndian.PutUint32(p[8:], blocks)
	binary.LittleEndian.PutUint64(p[12:], math.Float64bits(ratio))
	binary.LittleEndian.PutUint32(p[20:], blockSize)
	binary.LittleEndian.PutUint32(p[24:], uint32(prio))
	return p
}

func TestTheAllowanceBoundsWhatIsSentOnArrival(t *testing.T) {
	c := &control{out: make(chan []byte, 16), pending: make(map[uint32]chan reply)}
	body := make([]byte, 64) // 16 tokens at 0.25 per byte
	if _, ok := c.trySend(1, routeCompletions, body, 16); ok {
		t.Fatal("sent before any allowance")
	}
	c.setAllowance(allowanceFrame(0, 2, 10, 0.25, 16, -1))
	for id := uint32(1); id <= 2; id++ { // 32 tokens: two blocks each
		if prio, ok := c.trySend(id, routeCompletions, body, 16); !ok || prio != -1 {
			t.Fatalf("request %d: sent %v priority %d", id, ok, prio)
		}
	}
	if _, ok := c.trySend(3, routeCompletions, body, 16); ok {
		t.Fatal("sent past the allowance's count")
	}
	if len(c.out) != 2 || (<-c.out)[0] != kindSent {
		t.Fatal("each request sent on arrival is reported")
	}
	// The sidecar has seen one of the two: its new allowance counts from there.
	c.setAllowance(allowanceFrame(1, 2, 4, 0.25, 16, -1))
	if _, ok := c.trySend(3, routeCompletions, body, 16); !ok {
		t.Fatal("the seen request no longer counts against the allowance")
	}
	c.setAllowance(allowanceFrame(3, 8, 4, 0.25, 16, -1))
	if _, ok := c.trySend(4, routeCompletions, body, 100); ok {
		t.Fatal("sent past the allowance's KV blocks")
	}
	c.arrive(5, routeCompletions, body) // awaiting its reply: nothing may overtake it
	if _, ok := c.trySend(6, routeCompletions, body, 1); ok {
		t.Fatal("a newcomer overtook a request awaiting its decision")
	}
}

func TestSendableBodies(t *testing.T) {
	cases := []struct {
		body   string
		tokens int
		ok     bool
	}{
		{`{"prompt":"x","max_tokens":7}`, 7, true},
		{` {"messages":[],"max_completion_tokens":5}`, 5, true},
		{`{"prompt":"x","max_tokens":0,"max_completion_tokens":3}`, 3, true},
		{`{"prompt":"x"}`, 0, false},                              // no length asked: the sidecar sizes it
		{`{"prompt":"x","max_tokens":4,"priority":-9}`, 0, false}, // a client priority is replaced there
		{`{"prompt":"x","max_tokens":-2}`, 0, false},
		{`{"prompt":"x","max_tokens":"4"}`, 0, false},
		{`[1,2]`, 0, false},
		{`not json`, 0, false},
	}
	for _, tc := range cases {
		tokens, ok := sendable([]byte(tc.body))
		if ok != tc.ok || tokens != tc.tokens {
			t.Errorf("%s: got (%d, %v), want (%d, %v)", tc.body, tokens, ok, tc.tokens, tc.ok)
		}
	}
}
