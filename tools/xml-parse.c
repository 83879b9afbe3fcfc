// SPDX-License-Identifier: GPL-2.0-only
/*
 * tools/xml-parse.c - reads thin_dump's XML into struct tsm_xml, with
 * libexpat, and rejects anything a well formed dump would not contain.
 *
 * The grammar accepted is exactly what thin_dump writes:
 *
 *   <superblock uuid time transaction flags version data_block_size
 *               nr_data_blocks>
 *     <device dev_id mapped_blocks transaction creation_time snap_time>
 *       <range_mapping origin_begin data_begin length time/>
 *       <single_mapping origin_block data_block time/>
 *     </device>
 *   </superblock>
 *
 * Every attribute is required, numbers are plain decimal, and an unknown
 * element or attribute, text between elements, a DOCTYPE (no entity
 * tricks), a value out of range, a duplicate device or a virtual block
 * mapped twice is an error, reported as one line naming the input line.
 * The whole document is read and checked before anything is written, so
 * a bad dump never damages the output of a restore.
 */
#define DM_MSG_PREFIX "thin-scalable-meta"

#include <ctype.h>
#include <stdarg.h>
#include <expat.h>

#include "tools/tsm.h"

/* What is open at the current point of the document. */
enum xml_level {
	LEVEL_TOP,		/* nothing yet, or after </superblock> */
	LEVEL_SUPERBLOCK,
	LEVEL_DEVICE,
	LEVEL_MAPPING,		/* inside a (empty) mapping element */
};

struct parse_state {
	XML_Parser p;
	const char *name;	/* input name, for messages */
	struct tsm_xml *x;
	enum xml_level level;
	bool seen_superblock;
	bool no_data_bounds;
	bool failed;
	char *err;
	size_t errlen;
};

/* Record the first error and stop expat. */
static void __attribute__((format(printf, 2, 3)))
parse_fail(struct parse_state *st, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (st->failed)
		return;
	st->failed = true;
	n = snprintf(st->err, st->errlen, "%s:%lu: ", st->name,
		     (unsigned long)XML_GetCurrentLineNumber(st->p));
	if (n < 0 || (size_t)n >= st->errlen)
		n = 0;
	va_start(ap, fmt);
	vsnprintf(st->err + n, st->errlen - n, fmt, ap);
	va_end(ap);
	XML_StopParser(st->p, XML_FALSE);
}

/* Plain decimal, no sign, no blanks, at most @max. */
static int parse_number(const char *s, u64 max, u64 *result)
{
	u64 v = 0;

	if (!*s)
		return -1;
	for (; *s; s++) {
		unsigned int d;

		if (*s < '0' || *s > '9')
			return -1;
		d = *s - '0';
		if (v > (UINT64_MAX - d) / 10)
			return -1;
		v = v * 10 + d;
	}
	if (v > max)
		return -1;
	*result = v;
	return 0;
}

/* One attribute an element must carry. */
struct attr_spec {
	const char *name;
	u64 max;	/* largest value accepted */
	u64 *out;	/* NULL: a string, stored through @str */
	char **str;
};

/*
 * Fill in every attribute of @spec from @atts; each must be present
 * exactly once and nothing else may be.  Returns 0 or -1 (failed).
 */
static int get_attrs(struct parse_state *st, const char *elem,
		     const XML_Char **atts, const struct attr_spec *spec,
		     unsigned int nr)
{
	bool seen[8] = { false };
	unsigned int i;

	BUG_ON(nr > ARRAY_SIZE(seen));
	for (; atts[0]; atts += 2) {
		for (i = 0; i < nr; i++)
			if (!strcmp(atts[0], spec[i].name))
				break;
		if (i == nr) {
			parse_fail(st, "<%s>: unknown attribute '%s'", elem,
				   atts[0]);
			return -1;
		}
		/* expat already refuses duplicate attributes */
		seen[i] = true;
		if (!spec[i].out) {
			char *s = strdup(atts[1]);

			if (!s) {
				parse_fail(st, "out of memory");
				return -1;
			}
			free(*spec[i].str);
			*spec[i].str = s;
			continue;
		}
		if (parse_number(atts[1], spec[i].max, spec[i].out)) {
			parse_fail(st, "<%s>: %s=\"%.40s\" is not a number in 0..%llu",
				   elem, spec[i].name, atts[1],
				   (unsigned long long)spec[i].max);
			return -1;
		}
	}
	for (i = 0; i < nr; i++) {
		if (!seen[i]) {
			parse_fail(st, "<%s>: missing attribute '%s'", elem,
				   spec[i].name);
			return -1;
		}
	}
	return 0;
}

static void start_superblock(struct parse_state *st, const XML_Char **atts)
{
	struct tsm_xml *x = st->x;
	u64 time, trans, flags, version, dbs, nr;
	const struct attr_spec spec[] = {
		{ "uuid", 0, NULL, &x->uuid },
		{ "time", TSM_MAX_TIME, &time, NULL },
		{ "transaction", UINT64_MAX, &trans, NULL },
		{ "flags", UINT32_MAX, &flags, NULL },
		{ "version", UINT32_MAX, &version, NULL },
		{ "data_block_size", UINT32_MAX, &dbs, NULL },
		{ "nr_data_blocks", TSM_MAX_DATA_BLOCKS, &nr, NULL },
	};

	if (st->level != LEVEL_TOP || st->seen_superblock) {
		parse_fail(st, "<superblock> must be the one top element");
		return;
	}
	st->seen_superblock = true;
	st->level = LEVEL_SUPERBLOCK;
	if (get_attrs(st, "superblock", atts, spec, ARRAY_SIZE(spec)))
		return;
	if (version < 1 || version > 2) {
		parse_fail(st, "<superblock>: unsupported metadata version %llu (1 or 2)",
			   (unsigned long long)version);
		return;
	}
	if (flags & ~1ULL) {
		parse_fail(st, "<superblock>: flags=%llu has bits other than needs_check (1)",
			   (unsigned long long)flags);
		return;
	}
	if (dbs < TSP_DATA_BLOCK_SIZE_MIN_SECTORS ||
	    dbs > TSP_DATA_BLOCK_SIZE_MAX_SECTORS ||
	    dbs % TSP_DATA_BLOCK_SIZE_MIN_SECTORS) {
		parse_fail(st, "<superblock>: data_block_size=%llu must be a multiple of %u sectors between %u and %u",
			   (unsigned long long)dbs,
			   TSP_DATA_BLOCK_SIZE_MIN_SECTORS,
			   TSP_DATA_BLOCK_SIZE_MIN_SECTORS,
			   TSP_DATA_BLOCK_SIZE_MAX_SECTORS);
		return;
	}
	x->time = time;
	x->transaction = trans;
	x->flags = flags;
	x->version = version;
	x->data_block_size = dbs;
	x->nr_data_blocks = nr;
}

static void start_device(struct parse_state *st, const XML_Char **atts)
{
	struct tsm_xml *x = st->x;
	struct tsm_xml_device *d;
	u64 id, mapped, trans, ctime, stime;
	const struct attr_spec spec[] = {
		{ "dev_id", TSP_THIN_MAX_DEV_ID, &id, NULL },
		{ "mapped_blocks", UINT64_MAX, &mapped, NULL },
		{ "transaction", UINT64_MAX, &trans, NULL },
		{ "creation_time", UINT32_MAX, &ctime, NULL },
		{ "snap_time", UINT32_MAX, &stime, NULL },
	};

	if (st->level != LEVEL_SUPERBLOCK) {
		parse_fail(st, "<device> outside <superblock>");
		return;
	}
	st->level = LEVEL_DEVICE;
	if (get_attrs(st, "device", atts, spec, ARRAY_SIZE(spec)))
		return;
	if (x->nr_devs == x->alloc_devs) {
		size_t n = x->alloc_devs ? x->alloc_devs * 2 : 16;
		struct tsm_xml_device *nd = realloc(x->devs, n * sizeof(*nd));

		if (!nd) {
			parse_fail(st, "out of memory");
			return;
		}
		x->devs = nd;
		x->alloc_devs = n;
	}
	d = &x->devs[x->nr_devs++];
	memset(d, 0, sizeof(*d));
	d->dev_id = id;
	d->mapped_blocks = mapped;
	d->transaction = trans;
	d->creation_time = ctime;
	d->snap_time = stime;
	d->line = XML_GetCurrentLineNumber(st->p);
}

static void add_mapping(struct parse_state *st, const char *elem,
			u64 origin, u64 data, u64 length, u64 time)
{
	struct tsm_xml_device *d = &st->x->devs[st->x->nr_devs - 1];
	struct tsm_xml_mapping *m;

	if (!length) {
		parse_fail(st, "<%s>: length must not be 0", elem);
		return;
	}
	if (origin > UINT64_MAX - length) {
		parse_fail(st, "<%s>: virtual blocks %llu + %llu overflow",
			   elem, (unsigned long long)origin,
			   (unsigned long long)length);
		return;
	}
	if (st->no_data_bounds) {
		if (data >= TSM_MAX_DATA_BLOCKS ||
		    length > TSM_MAX_DATA_BLOCKS - data) {
			parse_fail(st, "<%s>: data block out of range", elem);
			return;
		}
	} else if (data >= st->x->nr_data_blocks ||
		   length > st->x->nr_data_blocks - data) {
		parse_fail(st, "<%s>: data block %llu%s is beyond nr_data_blocks=%llu",
			   elem, (unsigned long long)(data + length - 1),
			   length > 1 ? " (end of range)" : "",
			   (unsigned long long)st->x->nr_data_blocks);
		return;
	}
	if (d->nr_maps == d->alloc_maps) {
		size_t n = d->alloc_maps ? d->alloc_maps * 2 : 16;
		struct tsm_xml_mapping *nm = realloc(d->maps, n * sizeof(*nm));

		if (!nm) {
			parse_fail(st, "out of memory");
			return;
		}
		d->maps = nm;
		d->alloc_maps = n;
	}
	m = &d->maps[d->nr_maps++];
	m->origin = origin;
	m->data = data;
	m->length = length;
	m->time = time;
	m->line = XML_GetCurrentLineNumber(st->p);
}

static void start_range(struct parse_state *st, const XML_Char **atts)
{
	u64 origin, data, length, time;
	const struct attr_spec spec[] = {
		{ "origin_begin", UINT64_MAX, &origin, NULL },
		{ "data_begin", UINT64_MAX, &data, NULL },
		{ "length", UINT64_MAX, &length, NULL },
		{ "time", TSM_MAX_TIME, &time, NULL },
	};

	if (st->level != LEVEL_DEVICE) {
		parse_fail(st, "<range_mapping> outside <device>");
		return;
	}
	st->level = LEVEL_MAPPING;
	if (get_attrs(st, "range_mapping", atts, spec, ARRAY_SIZE(spec)))
		return;
	add_mapping(st, "range_mapping", origin, data, length, time);
}

static void start_single(struct parse_state *st, const XML_Char **atts)
{
	u64 origin, data, time;
	const struct attr_spec spec[] = {
		{ "origin_block", UINT64_MAX, &origin, NULL },
		{ "data_block", UINT64_MAX, &data, NULL },
		{ "time", TSM_MAX_TIME, &time, NULL },
	};

	if (st->level != LEVEL_DEVICE) {
		parse_fail(st, "<single_mapping> outside <device>");
		return;
	}
	st->level = LEVEL_MAPPING;
	if (get_attrs(st, "single_mapping", atts, spec, ARRAY_SIZE(spec)))
		return;
	add_mapping(st, "single_mapping", origin, data, 1, time);
}

static void XMLCALL on_start(void *ctx, const XML_Char *name,
			     const XML_Char **atts)
{
	struct parse_state *st = ctx;

	if (st->failed)
		return;
	if (!strcmp(name, "superblock"))
		start_superblock(st, atts);
	else if (!strcmp(name, "device"))
		start_device(st, atts);
	else if (!strcmp(name, "range_mapping"))
		start_range(st, atts);
	else if (!strcmp(name, "single_mapping"))
		start_single(st, atts);
	else
		parse_fail(st, "unknown element <%.40s>", name);
}

static int cmp_mapping(const void *a, const void *b)
{
	const struct tsm_xml_mapping *ma = a, *mb = b;

	if (ma->origin != mb->origin)
		return ma->origin < mb->origin ? -1 : 1;
	return 0;
}

/* Sort a finished device's mappings and refuse overlaps. */
static void end_device(struct parse_state *st)
{
	struct tsm_xml_device *d = &st->x->devs[st->x->nr_devs - 1];
	bool sorted = true;
	size_t i;

	for (i = 1; i < d->nr_maps; i++)
		if (d->maps[i].origin < d->maps[i - 1].origin)
			sorted = false;
	if (!sorted)
		qsort(d->maps, d->nr_maps, sizeof(*d->maps), cmp_mapping);
	d->nr_blocks = 0;
	for (i = 0; i < d->nr_maps; i++) {
		if (i && d->maps[i].origin <
			 d->maps[i - 1].origin + d->maps[i - 1].length) {
			parse_fail(st, "device %llu: virtual block %llu is mapped twice (lines %lu and %lu)",
				   (unsigned long long)d->dev_id,
				   (unsigned long long)d->maps[i].origin,
				   d->maps[i - 1].line, d->maps[i].line);
			return;
		}
		d->nr_blocks += d->maps[i].length;
	}
	st->x->nr_blocks += d->nr_blocks;
}

static void XMLCALL on_end(void *ctx, const XML_Char *name)
{
	struct parse_state *st = ctx;

	if (st->failed)
		return;
	switch (st->level) {
	case LEVEL_MAPPING:
		st->level = LEVEL_DEVICE;
		break;
	case LEVEL_DEVICE:
		st->level = LEVEL_SUPERBLOCK;
		end_device(st);
		break;
	case LEVEL_SUPERBLOCK:
		st->level = LEVEL_TOP;
		break;
	case LEVEL_TOP:
		/* expat matches tags, so this cannot happen */
		parse_fail(st, "unexpected </%s>", name);
		break;
	}
}

static void XMLCALL on_text(void *ctx, const XML_Char *s, int len)
{
	struct parse_state *st = ctx;
	int i;

	if (st->failed)
		return;
	for (i = 0; i < len; i++) {
		if (!isspace((unsigned char)s[i])) {
			parse_fail(st, "unexpected text '%.*s'",
				   len - i > 20 ? 20 : len - i, s + i);
			return;
		}
	}
}

static void XMLCALL on_doctype(void *ctx, const XML_Char *name,
			       const XML_Char *sysid, const XML_Char *pubid,
			       int has_internal_subset)
{
	parse_fail(ctx, "a DOCTYPE is not allowed in a thin_dump document");
}

static int cmp_device(const void *a, const void *b)
{
	const struct tsm_xml_device *da = a, *db = b;

	if (da->dev_id != db->dev_id)
		return da->dev_id < db->dev_id ? -1 : 1;
	return 0;
}

void tsm_xml_free(struct tsm_xml *x)
{
	size_t i;

	for (i = 0; i < x->nr_devs; i++)
		free(x->devs[i].maps);
	free(x->devs);
	free(x->uuid);
	memset(x, 0, sizeof(*x));
}

static void parse_init(struct parse_state *st, const char *name,
		       struct tsm_xml *x, char *err, size_t errlen)
{
	memset(x, 0, sizeof(*x));
	memset(st, 0, sizeof(*st));
	st->name = name;
	st->x = x;
	st->err = err;
	st->errlen = errlen;
	err[0] = '\0';
}

static int parse_setup(struct parse_state *st)
{
	st->p = XML_ParserCreate(NULL);
	if (!st->p) {
		snprintf(st->err, st->errlen, "%s: out of memory", st->name);
		return -1;
	}
	XML_SetUserData(st->p, st);
	XML_SetElementHandler(st->p, on_start, on_end);
	XML_SetCharacterDataHandler(st->p, on_text);
	XML_SetStartDoctypeDeclHandler(st->p, on_doctype);
	return 0;
}

/* Called with each chunk; @last for the final one.  0 or -1. */
static int parse_chunk(struct parse_state *st, const char *buf, size_t len,
		       bool last)
{
	while (len || last) {
		int n = len > (1 << 30) ? (1 << 30) : (int)len;

		len -= n;
		if (XML_Parse(st->p, buf, n, last && !len) == XML_STATUS_ERROR) {
			if (!st->failed) {
				st->failed = true;
				snprintf(st->err, st->errlen, "%s:%lu: malformed XML: %s",
					 st->name,
					 (unsigned long)XML_GetCurrentLineNumber(st->p),
					 XML_ErrorString(XML_GetErrorCode(st->p)));
			}
			return -1;
		}
		if (st->failed)
			return -1;
		buf += n;
		if (last && !len)
			break;
	}
	return 0;
}

/* After the last chunk: whole-document checks. */
static int parse_finish(struct parse_state *st)
{
	struct tsm_xml *x = st->x;
	size_t i;

	if (!st->seen_superblock) {
		snprintf(st->err, st->errlen, "%s: no <superblock> element",
			 st->name);
		return -1;
	}
	if (x->nr_devs > 1)
		qsort(x->devs, x->nr_devs, sizeof(*x->devs), cmp_device);
	for (i = 1; i < x->nr_devs; i++) {
		if (x->devs[i].dev_id == x->devs[i - 1].dev_id) {
			snprintf(st->err, st->errlen,
				 "%s: device %llu appears twice (lines %lu and %lu)",
				 st->name,
				 (unsigned long long)x->devs[i].dev_id,
				 min(x->devs[i].line, x->devs[i - 1].line),
				 max(x->devs[i].line, x->devs[i - 1].line));
			return -1;
		}
	}
	if (!x->uuid) {
		x->uuid = strdup("");
		if (!x->uuid) {
			snprintf(st->err, st->errlen, "%s: out of memory",
				 st->name);
			return -1;
		}
	}
	return 0;
}

int tsm_xml_parse_buffer(const char *buf, size_t len, bool no_data_bounds,
			 struct tsm_xml *x, char *err, size_t errlen)
{
	struct parse_state st;
	int r;

	parse_init(&st, "thin_dump output", x, err, errlen);
	st.no_data_bounds = no_data_bounds;
	r = parse_setup(&st);
	if (!r)
		r = parse_chunk(&st, buf, len, true);
	if (!r)
		r = parse_finish(&st);
	if (st.p)
		XML_ParserFree(st.p);
	if (r)
		tsm_xml_free(x);
	return r;
}

int tsm_xml_parse_file(const char *path, struct tsm_xml *x,
		       char *err, size_t errlen)
{
	struct parse_state st;
	static char buf[1 << 16];
	FILE *f;
	int r;

	parse_init(&st, path, x, err, errlen);
	f = fopen(path, "r");
	if (!f) {
		snprintf(err, errlen, "cannot open %s: %s", path,
			 strerror(errno));
		return -1;
	}
	r = parse_setup(&st);
	while (!r) {
		size_t n = fread(buf, 1, sizeof(buf), f);

		if (ferror(f)) {
			snprintf(err, errlen, "cannot read %s: %s", path,
				 strerror(errno));
			r = -1;
			break;
		}
		r = parse_chunk(&st, buf, n, feof(f));
		if (feof(f))
			break;
	}
	fclose(f);
	if (!r)
		r = parse_finish(&st);
	if (st.p)
		XML_ParserFree(st.p);
	if (r)
		tsm_xml_free(x);
	return r;
}
